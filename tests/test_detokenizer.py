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
