"""The pure core's vocabulary: tasks print and parse back, and the one ready rule."""
import pytest

from megatron_dpp.pipeline import Phase, ReadyTracker, Task, TaskGraph, format_tasks, parse_tasks


@pytest.mark.parametrize("task", [Task(Phase.F, 3, 1), Task(Phase.B, 0, 0), Task(Phase.W, 127, 4)])
def test_a_task_prints_and_parses_back(task):
    assert Task.parse(str(task)) == task


def test_the_short_form():
    assert str(Task(Phase.F, 3, 1)) == "F3.1"
    assert Task.parse(" B12.0 ") == Task(Phase.B, 12, 0)
    order = [Task(Phase.F, 0, 0), Task(Phase.F, 1, 0), Task(Phase.B, 0, 0), Task(Phase.W, 0, 0)]
    assert format_tasks(order) == "F0.0 F1.0 B0.0 W0.0"
    assert parse_tasks(format_tasks(order)) == order


@pytest.mark.parametrize("text", ["", "F3", "X3.1", "F-1.0", "F3.1.2", "f3.1"])
def test_what_is_not_a_task_is_refused(text):
    with pytest.raises(ValueError, match="expected a phase"):
        Task.parse(text)


def test_ready_rule_on_a_first_middle_and_last_stage():
    graph = TaskGraph(3, 1, 2)
    first, middle, last = (ReadyTracker(graph, rank) for rank in range(3))
    assert first.ready == {Task(Phase.F, 0, 0), Task(Phase.F, 1, 0)}  # it reads data
    assert middle.ready == set() and last.ready == set()
    assert not first.needs_input(Task(Phase.F, 0, 0)) and middle.needs_input(Task(Phase.F, 0, 0))

    last.input_arrived(Task(Phase.F, 0, 0))
    last.start(Task(Phase.F, 0, 0))
    assert last.ready == set()
    last.finish(Task(Phase.F, 0, 0))
    assert last.ready == {Task(Phase.B, 0, 0)}  # the loss makes its gradient

    middle.input_arrived(Task(Phase.B, 1, 0))  # a gradient before its forward ran: held back
    assert middle.ready == set()
    middle.input_arrived(Task(Phase.F, 1, 0))
    middle.start(Task(Phase.F, 1, 0))
    middle.finish(Task(Phase.F, 1, 0))
    assert middle.ready == {Task(Phase.B, 1, 0)}
    with pytest.raises(RuntimeError, match="not ready"):
        middle.start(Task(Phase.B, 0, 0))


def test_ready_rule_with_split_backwards_and_forward_only():
    graph = TaskGraph(1, 1, 1, split_backward=True)
    tracker = ReadyTracker(graph, 0)
    for task in (Task(Phase.F, 0, 0), Task(Phase.B, 0, 0)):
        tracker.start(task)
        tracker.finish(task)
    assert tracker.ready == {Task(Phase.W, 0, 0)}

    evaluation = ReadyTracker(graph, 0, forward_only=True)
    evaluation.start(Task(Phase.F, 0, 0))
    evaluation.finish(Task(Phase.F, 0, 0))
    assert evaluation.ready == set()
