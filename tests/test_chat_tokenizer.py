"""Tokenizer: both encoders, decode as `tokenizers` does, and the incremental detokenizer's split invariance."""
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from dsv41 import BUILTIN_TOKENIZER_DIR
from dsv41.chat.tokenizer import IncrementalDetokenizer, Tokenizer


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.builtin()


def test_builtin_is_kit_tokenizer(tok, shared):
    assert (BUILTIN_TOKENIZER_DIR / "tokenizer.json").read_bytes() == (shared / "tokenizer/tokenizer.json").read_bytes()
    assert tok.path == BUILTIN_TOKENIZER_DIR / "tokenizer.json"
    assert (tok.bos_id, tok.eos_id, tok.think_start_id, tok.think_end_id, tok.image_id) == (0, 1, 128821, 128822,
                                                                                           129264)
    with pytest.raises(FileNotFoundError):
        Tokenizer.from_dir(BUILTIN_TOKENIZER_DIR / "missing")


def test_special_and_plain(tok):
    assert tok.encode("<｜User｜>", special=True) == [128803]
    plain = tok.encode("<｜User｜>", special=False)
    assert 128803 not in plain and tok.decode(plain) == "<｜User｜>"
    assert tok.encode("a ｜DSML｜ b", special=True).count(128825) == 1
    assert 128825 not in tok.encode("a ｜DSML｜ b", special=False)
    assert tok.encode("", special=True) == []


def test_decode_equals_tokenizers(tok):
    ids = tok.encode("héllo 你好 😀 <think>x</think>\n\n<｜User｜>", special=True) + [5000, 100000, 2]
    assert tok.decode(ids) == tok.full.decode(ids, skip_special_tokens=False)
    with pytest.raises(ValueError):
        tok.decode([tok.vocab_size])


TEXT = st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=40)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=TEXT, data=st.data())
def test_detokenizer_split_invariant(tok, text, data):
    ids = tok.encode(text, special=True)
    assert tok.decode(ids) == text
    cuts = sorted(data.draw(st.lists(st.integers(0, len(ids)), max_size=8)))
    d, out, pos = IncrementalDetokenizer(tok), [], 0
    for c in cuts + [len(ids)]:
        for i in ids[pos:c]:
            out.append(d.push(i))
        pos = c
    out.append(d.finish())
    assert "".join(out) == text
    assert all("\ufffd" not in piece for piece in out) or "\ufffd" in text  # never half a character


def test_detokenizer_holds_partial_characters(tok):
    # '😀' is 4 bytes; find ids that split it, feed them one by one
    ids = tok.encode("😀😀😀", special=True)
    d = IncrementalDetokenizer(tok)
    pieces = [d.push(i) for i in ids]
    assert "".join(pieces) == "😀😀😀" and all(p in ("", "😀", "😀😀", "😀😀😀") for p in pieces)
    d = IncrementalDetokenizer(tok)
    first = tok.token_bytes(ids[0])
    if len(first) < 4:   # a byte-level piece of the emoji: held, then flushed as U+FFFD at the end
        assert d.push(ids[0]) == "" and d.finish() == "\ufffd"


def test_chunked_encoding_equals_whole(tok):
    import random
    from dsv41.chat.tokenizer import chunks, encode_many
    rng = random.Random(0)
    lines = ["abc def", "12345 x", " leading", "\tTab", "。句子", "¡hola", "é", "", "x.", "<think>y", "a\r", "Über",
             "_x", "ǅz", "ʰmod", "…"]
    text = "\n".join(rng.choice(lines) for _ in range(6000))
    assert len(chunks(text, 1024)) > 10
    for enc in (tok.full, tok.plain):
        assert encode_many(enc, [text], size=1024)[0] == enc.encode(text, add_special_tokens=False).ids


def test_run_memo_gives_the_same_ids_and_is_bounded(tok):
    from dsv41.chat.tokenizer import RunMemo
    long_text = "word " * 400 + "\n"
    pieces = [("<｜User｜>", False), (long_text, True), ("<｜Assistant｜>", False), ("short", True)]
    cold = Tokenizer.encode_pieces(tok, pieces, shield=True)
    hits = tok.memo.hits
    warm = tok.encode_pieces(pieces, shield=True)
    assert warm == cold == [128803] + tok.encode(long_text, special=False) + [128804] + tok.encode("short", False)
    assert tok.memo.hits == hits + 1
    warm.append(-1)   # callers own their list
    assert tok.encode_pieces(pieces, shield=True) == cold
    memo = RunMemo(max_chars=3000, min_chars=10)
    for k in range(10):
        memo.put(str(k) * 1000, [k])
    assert memo._chars <= 3000 and memo.get("9" * 1000) == (9,) and memo.get("0" * 1000) is None
