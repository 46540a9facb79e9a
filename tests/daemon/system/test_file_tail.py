"""Reading the end of a growing log: whole lines only, whatever its length."""

from daemon.system.file_tail import tail_lines


def test_the_tail_holds_whole_lines_only_and_the_short_file_whole(tmp_path):
    log = tmp_path / "events.jsonl"
    log.write_bytes(b"".join(b'{"step": %d}\n' % i for i in range(1000)))
    tail = tail_lines(log, 100)
    assert tail and tail[-1] == b'{"step": 999}' and all(ln.startswith(b'{"step": ') for ln in tail)
    assert len(b"\n".join(tail)) < 100
    assert tail_lines(log, 1 << 20) == [b'{"step": %d}' % i for i in range(1000)]
    assert tail_lines(tmp_path / "missing", 100) is None
