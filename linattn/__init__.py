"""linattn: theory, simulation and real-data runs for linear attention in federated learning.

The distribution holds four parts (``linattn_theory``, ``simulations``, ``real_data``,
``figures``); this package only carries the version and the command-line router.
"""

__version__ = "0.1.0"
