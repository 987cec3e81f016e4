"""yarnapp.logview on real files: the last lines found from a file's end, a file copied in
pieces, and logs followed as they grow, are replaced, or end without a newline."""
import io
import os

import pytest

from yarnapp import logview

pytestmark = pytest.mark.unit


def _log(tmp_path, data, name="container.log"):
    p = tmp_path / name
    p.write_bytes(data)
    return str(p)


@pytest.mark.parametrize("data", [b"", b"a\n", b"a\nb\nc\n", b"a\nb\nc", b"\n\n\n", b"x" * 200_000 + b"\nlast"])
def test_the_last_lines_are_what_tail_prints(tmp_path, data, monkeypatch):
    monkeypatch.setattr(logview, "BLOCK", 7)        # lines across the blocks stepped back over
    path = _log(tmp_path, data)
    for n in range(5):
        want = b"".join(data.splitlines(keepends=True)[-n:]) if n else b""
        assert data[logview.tail_offset(path, n):] == want, (data[:20], n)
        assert logview.tail_text(data.decode(), n) == want.decode()


class _Out(io.StringIO):
    def __init__(self):
        super().__init__()
        self.buffer = io.BytesIO()


def test_a_log_is_copied_in_pieces_and_a_missing_last_newline_is_said(tmp_path, monkeypatch):
    monkeypatch.setattr(logview, "CHUNK", 10)
    for data, whole in ((b"one\ntwo\n", True), (b"one\ntwo", False), (b"", True)):
        out = _Out()
        assert logview.copy(_log(tmp_path, data), out, offset=4 if data else 0) is whole
        assert out.buffer.getvalue() == data[4 if data else 0:]


def test_a_followed_log_gives_whole_lines_once_and_starts_over_when_replaced(tmp_path, monkeypatch):
    monkeypatch.setattr(logview, "CHUNK", 4)
    path = _log(tmp_path, b"first\nsec")
    f = logview.Follower()
    assert list(f.lines({"a_0": path})) == [("a_0", "first")]
    with open(path, "ab") as fh:
        fh.write(b"ond\n10%\r20%\r\nbar")
    assert list(f.lines({"a_0": path})) == [("a_0", "second"), ("a_0", "20%")]      # a bar as last drawn
    assert list(f.lines({"a_0": path, "b_0": str(tmp_path / "not-yet.log")})) == []
    os.replace(_log(tmp_path, b"a longer file replaced it\n", "new.log"), path)   # another file there
    assert list(f.lines({"a_0": path})) == [("a_0", "a longer file replaced it")]
    with open(path, "wb") as fh:                                                  # truncated
        fh.write(b"x\n")
    assert list(f.lines({"a_0": path})) == [("a_0", "x")]
    with open(path, "ab") as fh:
        fh.write(b"no newline")
    assert list(f.lines({"a_0": path})) == [] and f.rest() == [("a_0", "no newline")]
    os.remove(path)
    assert list(f.lines({"a_0": path})) == []                                      # gone: nothing, no error


def test_a_line_that_never_ends_is_cut_not_held(tmp_path, monkeypatch):
    monkeypatch.setattr(logview, "CHUNK", 1000)
    monkeypatch.setattr(logview.Follower, "LONGEST", 1000)
    path = _log(tmp_path, b"y" * 10_000)
    got = list(logview.Follower().lines({"a_0": path}))
    assert "".join(line for _, line in got) == "y" * 10_000 and all(len(line) <= 2000 for _, line in got)
