"""A rank's line goes out in one write, so that the ranks sharing a pipe never run two lines
together (print() writes the text and its newline apart, each its own system call unbuffered)."""
import subprocess
import sys
import textwrap

from megatron_dpp.one_write import say


class _Recorder:
    def __init__(self):
        self.writes = []
        self.flushes = 0

    def write(self, text):
        self.writes.append(text)

    def flush(self):
        self.flushes += 1


def test_a_line_and_its_newline_are_one_write_then_flushed():
    stream = _Recorder()
    say("megatron_dpp: warning: something", stream)
    assert stream.writes == ["megatron_dpp: warning: something\n"]
    assert stream.flushes == 1


def test_unbuffered_processes_sharing_a_pipe_keep_their_lines_whole():
    # Two writers at once on one pipe, as the ranks of a node under PYTHONUNBUFFERED.
    writer = textwrap.dedent("""
        import sys
        from megatron_dpp.one_write import say
        for index in range(300):
            say(f"writer {sys.argv[1]} line {index} " + "x" * 200)
    """)
    command = (f"{sys.executable} -u -c '{writer}' 0 & {sys.executable} -u -c '{writer}' 1 & "
               f"wait")
    result = subprocess.run(["bash", "-c", command], stderr=subprocess.PIPE, text=True,
                            timeout=120, check=True)
    lines = result.stderr.splitlines()
    assert len(lines) == 600
    for line in lines:
        assert line.startswith("writer ") and line.endswith(" " + "x" * 200), line
