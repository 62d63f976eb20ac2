"""The record of positions a model proposer skips (spec_decode/skipped.py): what a request caught up on after a
spell asleep is exactly the target's hidden rows of the positions it missed, the last window of them at most."""

from __future__ import annotations

import numpy as np
import torch

from kvserve.spec_decode.skipped import SkippedPositions


def hidden_of(positions: np.ndarray, row: int) -> torch.Tensor:
    """A hidden row that names its request row and position."""
    out = torch.zeros(len(positions), 4)
    out[:, 0] = torch.from_numpy(positions).float()
    out[:, 1] = row
    return out


def sleep_steps(record: SkippedPositions, reqs: dict[str, int], spans: list[dict[str, tuple[int, int, int]]]):
    """Each step: req -> (start, number of tokens in the step, computed count after it)."""
    for step in spans:
        names = list(step)
        rows = np.array([reqs[n] for n in names])
        lens = np.array([step[n][1] for n in names])
        token_start = np.cumsum(lens) - lens
        starts = np.array([step[n][0] for n in names])
        ends = np.array([step[n][2] for n in names])
        hidden = torch.cat([hidden_of(np.arange(s, s + n), r) for s, n, r in zip(starts, lens, rows, strict=True)])
        record.remember(names.__getitem__, rows, token_start, starts, ends, hidden)


def test_caught_up_rows_are_the_missed_positions():
    record = SkippedPositions(keep_hidden=True, window=8)
    reqs = {"a": 0, "b": 3}
    # a: a 5-token chunk, then decodes with a rejected draft (3 tokens in the step, 2 kept); b: one decode each.
    sleep_steps(
        record,
        reqs,
        [{"a": (0, 5, 5), "b": (20, 1, 21)}, {"a": (5, 3, 6), "b": (21, 1, 22)}, {"a": (6, 1, 7), "b": (22, 1, 23)}],
    )
    first, rows = record.take("a", 0, 7)
    assert first == 0 and rows[:, 0].tolist() == list(range(7)) and (rows[:, 1] == 0).all()
    assert record.take("a", 0, 7) is None  # the record went with the catch-up
    first, rows = record.take("b", 3, 23)
    assert first == 20 and rows[:, 0].tolist() == [20, 21, 22] and (rows[:, 1] == 3).all()


def test_only_the_last_window_is_kept_and_rows_are_reused_cleanly():
    record = SkippedPositions(keep_hidden=True, window=8)
    reqs = {"a": 1}
    sleep_steps(record, reqs, [{"a": (0, 20, 20)}] + [{"a": (p, 1, p + 1)} for p in range(20, 30)])
    first, rows = record.take("a", 1, 30)
    assert first == 22 and rows[:, 0].tolist() == list(range(22, 30))
    # A request that leaves clears its row for the next one there.
    sleep_steps(record, reqs, [{"a": (30, 1, 31)}])
    record.forget("a")
    assert not record.any_behind(np.array([1]))
    sleep_steps(record, {"c": 1}, [{"c": (4, 2, 6)}])
    first, rows = record.take("c", 1, 6)
    assert first == 4 and rows[:, 0].tolist() == [4, 5]


def test_without_hidden_rows_only_positions_are_kept():
    record = SkippedPositions(keep_hidden=False, window=8)
    sleep_steps(record, {"a": 0}, [{"a": (10, 1, 11)}, {"a": (11, 1, 12)}])
    assert record.take("a", 0, 12) == (10, None)
    assert not record.any_behind(np.array([0, 5, 100]))


def test_an_entry_that_computed_nothing_does_not_shift_the_others_ids():
    record = SkippedPositions(keep_hidden=False, window=8)
    # "idle" sits in the step with nothing computed (end == start); "b" after it falls asleep.
    sleep_steps(record, {"idle": 0, "b": 2}, [{"idle": (5, 1, 5), "b": (9, 1, 10)}])
    record.forget("b")  # must clear b's row, which only works if the record knows b by its own id
    assert not record.any_behind(np.array([0, 2]))


def test_decodes_between_awake_requests_keep_their_own_rows():
    """One decode each, the sleeping requests' tokens not consecutive in the step (an awake one between them):
    each ring row gets its own request's hidden row, both on the gather path and the consecutive-rows one."""
    record = SkippedPositions(keep_hidden=True, window=8)
    for p in range(3):
        # The step's tokens: a (row 0), awake (row 1), b (row 2); only a and b are passed as asleep.
        hidden = torch.cat(
            [hidden_of(np.array([p]), 0), hidden_of(np.array([50 + p]), 1), hidden_of(np.array([p + 9]), 2)]
        )
        record.remember(
            ["a", "b"].__getitem__,
            np.array([0, 2]),
            np.array([0, 2]),
            np.array([p, p + 9]),
            np.array([p + 1, p + 10]),
            hidden,
        )
    # And a step where only b sleeps (one consecutive row).
    hidden = torch.cat([hidden_of(np.array([3]), 0), hidden_of(np.array([12]), 2)])
    record.remember(["b"].__getitem__, np.array([2]), np.array([1]), np.array([12]), np.array([13]), hidden)
    first, rows = record.take("a", 0, 3)
    assert first == 0 and rows[:, 0].tolist() == [0, 1, 2] and (rows[:, 1] == 0).all()
    first, rows = record.take("b", 2, 13)
    assert first == 9 and rows[:, 0].tolist() == [9, 10, 11, 12] and (rows[:, 1] == 2).all()


def test_without_hidden_rows_a_request_keeps_its_first_missed_position():
    """A draft model's record is only where its KV stops: once every sleeper has one, a step changes nothing (the
    proposer then skips the record altogether), and a new sleeper or one that woke up gets its own again."""
    record = SkippedPositions(keep_hidden=False, window=8)
    reqs = {"a": 0, "b": 2}
    assert not record.all_recorded(np.array([0, 2]))
    sleep_steps(record, reqs, [{"a": (10, 1, 11)}])
    assert record.all_recorded(np.array([0])) and not record.all_recorded(np.array([0, 2]))
    sleep_steps(record, reqs, [{"a": (11, 1, 12), "b": (40, 1, 41)}, {"a": (12, 1, 13), "b": (41, 1, 42)}])
    assert record.all_recorded(np.array([0, 2]))
    assert record.take("a", 0, 13) == (10, None)
    assert not record.all_recorded(np.array([0, 2]))
    assert record.take("b", 2, 42) == (40, None)


class _State:
    def __init__(self, req_id: str) -> None:
        self.req_id = req_id


def test_deferred_decode_steps_record_what_immediate_ones_do():
    """All-asleep decode steps recorded later, DEFER_STEPS at a time or before a read, give exactly the records of
    steps recorded at once: first positions and hidden rows, for requests falling asleep midway too."""
    from kvserve.spec_decode.skipped import DEFER_STEPS

    for keep_hidden in (True, False):
        now, later = SkippedPositions(keep_hidden, window=8), SkippedPositions(keep_hidden, window=8)
        reqs = {"a": 0, "b": 5, "c": 2}
        steps = [{"a": p, "b": 30 + p} for p in range(3, 3 + DEFER_STEPS + 3)]
        steps += [{"a": p, "b": 30 + p, "c": 50 + p} for p in range(14, 20)]  # c falls asleep midway
        for step in steps:
            names = list(step)
            rows = np.array([reqs[n] for n in names])
            positions = np.array([step[n] for n in names])
            hidden = torch.cat([hidden_of(positions[i : i + 1], int(rows[i])) for i in range(len(names))])
            now.remember(names.__getitem__, rows, np.arange(len(names)), positions, positions + 1, hidden)
            later.defer([_State(n) for n in names], rows, positions, hidden)
        assert later._deferred  # some wait for a read
        for name, end in (("a", 20), ("b", 50), ("c", 70)):
            want, got = now.take(name, reqs[name], end), later.take(name, reqs[name], end)
            assert want[0] == got[0]
            assert (want[1] is None and got[1] is None) or torch.equal(want[1], got[1])
        assert later.take("a", 0, 20) is None
