from engine.detokenizer import WordStreamer

# A toy vocabulary: some tokens are word pieces, one is half of a CJK character's bytes.
VOCAB = {1: "Hel", 2: "lo", 3: " wor", 4: "ld", 5: "\n", 6: " 你", 7: "好", 8: " ", 9: "!"}


def decode(ids):
    return "".join(VOCAB[i] for i in ids)


def run(ids):
    s = WordStreamer(decode)
    pieces = [s.push(i) for i in ids]
    return pieces, s.flush()


def test_words_come_out_whole():
    pieces, rest = run([1, 2, 3, 4, 8, 1])
    assert pieces == ["", "", "Hello ", "", "world ", ""]
    assert rest == "Hel"


def test_newline_flushes():
    pieces, rest = run([1, 2, 5, 3, 4])
    assert pieces == ["", "", "Hello\n", " ", ""]
    assert rest == "world"


def test_cjk_at_once():
    pieces, rest = run([6, 7, 9])
    assert pieces == [" 你", "好", ""]
    assert rest == "!"


def test_concatenation_is_the_text():
    ids = [1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 9]
    pieces, rest = run(ids)
    assert "".join(pieces) + rest == decode(ids)


def test_flush_of_nothing():
    assert WordStreamer(decode).flush() == ""


def _bytes_decode(vocab: dict[int, bytes]):
    # As a byte-level BPE tokenizer decodes: an unfinished UTF-8 sequence reads as U+FFFD.
    return lambda ids: b"".join(vocab[i] for i in ids).decode("utf-8", errors="replace")


def test_a_character_split_across_byte_tokens_comes_out_whole_never_as_a_replacement():
    # "é" (c3 a9) and "你" (e4 bd a0) each over several tokens, as byte-level vocabularies split them
    vocab = {1: b"caf", 2: b"\xc3", 3: b"\xa9", 4: b" ", 5: b"\xe4", 6: b"\xbd", 7: b"\xa0", 8: b"\xe5\xa5", 9: b"\xbd"}
    s = WordStreamer(_bytes_decode(vocab))
    pieces = [s.push(i) for i in (1, 2, 3, 4, 5, 6, 7, 8, 9)]
    assert pieces == ["", "", "", "café ", "", "", "你", "", "好"]
    assert s.flush() == "" and "\ufffd" not in "".join(pieces)


def test_cjk_at_the_edges_of_its_blocks_comes_out_at_once():
    # U+4E00 "一" (one) and U+9FFF open and close the unified block; U+3400 and U+4DBF are extension A
    # (U+2F800 and U+2FA1F the compatibility supplement).
    chars = ["\u4e00", "\u9fff", "\u3400", "\u4dbf", "\U0002f800", "\U0002fa1f"]
    vocab = dict(enumerate(chars))
    s = WordStreamer(lambda ids: "".join(vocab[i] for i in ids))
    assert [s.push(i) for i in vocab] == chars
    # just outside them: held back like any word
    for ch in ["\u4dc0", "\ua000", "\u33ff", "\U0002fa20"]:
        assert WordStreamer(lambda ids, ch=ch: ch * len(ids)).push(0) == ""


def test_a_newline_alone_is_released_and_starts_a_new_window():
    s = WordStreamer(decode)
    assert [s.push(i) for i in (5, 5, 1, 2, 8)] == ["\n", "\n", "", "", "Hello "]


def test_a_word_over_many_tokens_comes_out_whole():
    # a long number or address spelled one character a token
    vocab = {i: str(i % 10) for i in range(20)} | {99: " "}
    s = WordStreamer(lambda ids: "".join(vocab[i] for i in ids))
    pieces = [s.push(i) for i in [*range(20), 99]]
    assert pieces == [""] * 20 + ["01234567890123456789 "]
