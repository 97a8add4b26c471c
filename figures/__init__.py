"""Every figure, one standalone script each, and the reproduce-everything job.

``fig1_bias_drift`` .. ``fig8_partitions`` each draw one figure into figures/out/ (PNG and PDF)
and run alone (``python -m figures.fig3_optimal_warmup --quick``); ``cli`` is
``linattn reproduce`` / ``linattn figure N``; ``report`` writes report.md. Figures read the
simulator's validation result (``simulations.validate``), the theory (``linattn_theory``) and
real-data run directories; nothing imports ``figures``.
"""
