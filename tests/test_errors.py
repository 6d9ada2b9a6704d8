"""Bad input: the same error on every rank from the same call, nothing modified, no hang."""

from __future__ import annotations

import pytest
import torch

import compcomm

from rankpool import caught, group

WORLD = 4
NUMEL = 50


def bad_input(case: str, rank: int, ef: compcomm.ErrorFeedback) -> tuple[torch.Tensor, compcomm.ErrorFeedback, dict]:
    """This rank's arguments for `case`: only one rank's call is bad."""
    t, kwargs = torch.randn(NUMEL), {}
    if case == "nan" and rank == 2:
        t[17] = float("nan")
    elif case == "inf" and rank == 1:
        t[3] = float("-inf")
    elif case == "size" and rank == 1:
        return torch.randn(NUMEL + 1), compcomm.ErrorFeedback(), kwargs
    elif case == "int" and rank == 0:
        t = torch.arange(NUMEL)
    elif case == "device" and rank == 3:
        t = torch.empty(NUMEL, device="meta")
    elif case == "op" and rank == 2:
        kwargs["op"] = "max"
    elif case == "other_numel" and rank == 3:
        t = torch.randn(NUMEL + 8)
    elif case == "list" and rank == 1:
        return t.tolist(), ef, kwargs  # type: ignore[return-value]  # not a tensor at all
    return t, ef, kwargs


def bad_call(case: str) -> dict:
    """Warm the error state with one good call, make one bad call, then a good call again."""
    import torch.distributed as dist

    backend = compcomm.backends.get("gloo")
    ef = compcomm.ErrorFeedback()
    compcomm.compressed_allreduce(torch.randn(NUMEL), ef, backend=backend)
    state = (ef.worker_error.clone(), ef.server_error.clone())
    t, ef_used, kwargs = bad_input(case, dist.get_rank(), ef)
    t_before = t.clone() if isinstance(t, torch.Tensor) and t.device.type == "cpu" else None
    error = caught(compcomm.compressed_allreduce, t, ef_used, backend=backend, **kwargs)
    kept = (
        torch.equal(state[0], ef.worker_error)
        and torch.equal(state[1], ef.server_error)
        and (t_before is None or torch.equal(t_before.nan_to_num(), t.nan_to_num()))
    )
    after = torch.randn(NUMEL)
    compcomm.compressed_allreduce(after, ef, backend=backend)
    return {"error": error, "kept": kept, "after": after.numpy().tobytes()}


@pytest.mark.parametrize(
    "case, expected",
    [
        ("nan", "NonFiniteError"),
        ("inf", "NonFiniteError"),
        ("size", "ValueError"),
        ("int", "TypeError"),
        ("list", "TypeError"),
        ("device", "ValueError"),
        ("other_numel", "ValueError"),
        ("op", "ValueError"),
    ],
)
def test_bad_input_raises_everywhere_and_changes_nothing(pool, case, expected):
    results = pool.run(bad_call, case)
    errors = [r["error"] for r in results]
    assert all(e is not None for e in errors), errors
    assert {e[0] for e in errors} == {expected}, errors
    assert len({e[1] for e in errors}) == 1, f"ranks disagree on the message: {errors}"
    assert all(r["kept"] for r in results), "a failed call modified the tensor or the error state"
    assert len({r["after"] for r in results}) == 1, "the group is not usable after the failure"


def test_messages_say_what_is_wrong(pool):
    messages = {case: pool.run(bad_call, case)[0]["error"][1] for case in ("nan", "size", "int", "other_numel")}
    assert "rank(s) [2]" in messages["nan"]
    assert "[50, 51, 50, 50]" in messages["size"]
    assert "rank 0" in messages["int"] and "int64" in messages["int"]
    assert "rank 3" in messages["other_numel"] and "ErrorFeedback" in messages["other_numel"]


def limited_call(case: str) -> dict:
    """A call whose CallSpec.limits every rank sets below what its result may reach ("low"), or
    rank 1 to another value than the rest ("other"), after a good call; then a good call."""
    import torch.distributed as dist

    from compcomm.agreement import CallSpec
    from compcomm.allreduce import allreduce_call

    backend = compcomm.backends.get("gloo")
    ef = compcomm.ErrorFeedback()
    compcomm.compressed_allreduce(torch.randn(NUMEL), ef, backend=backend)
    state = (ef.worker_error.clone(), ef.server_error.clone())
    t = torch.randn(NUMEL)
    before = t.clone()
    limit = 1e-3 if case == "low" else (2e30 if dist.get_rank() == 1 else 1e30)
    error = caught(allreduce_call, CallSpec([t], [ef], limits=[limit]), backend)
    kept = torch.equal(state[0], ef.worker_error) and torch.equal(state[1], ef.server_error) and torch.equal(before, t)
    return {"error": error, "kept": kept}


@pytest.mark.parametrize(
    "case, expected, says",
    [("low", "NonFiniteError", "the caller's next step takes"), ("other", "ValueError", "largest result magnitude")],
)
def test_a_result_limit_refuses_alike_and_must_agree(pool, case, expected, says):
    results = pool.run(limited_call, case)
    assert {r["error"][0] for r in results} == {expected}
    assert len({r["error"][1] for r in results}) == 1 and says in results[0]["error"][1]
    assert all(r["kept"] for r in results)


def world_change() -> tuple | None:
    """An ErrorFeedback used over 4 ranks, then over a sub-group of 2: ValueError on both."""
    import torch.distributed as dist

    ef = compcomm.ErrorFeedback()
    compcomm.compressed_allreduce(torch.randn(NUMEL), ef, backend=compcomm.backends.get("gloo"))
    if dist.get_rank() >= 2:
        return None
    return caught(
        compcomm.compressed_allreduce, torch.randn(NUMEL), ef, backend=compcomm.backends.get("gloo", group=group(2))
    )


def test_error_feedback_reused_for_other_world_size(pool):
    results = pool.run(world_change)
    assert [r[0] for r in results[:2]] == ["ValueError", "ValueError"]
    assert "over 4 ranks" in results[0][1]


def test_type_errors_locally():
    with pytest.raises(TypeError):
        compcomm.compressed_allreduce(torch.arange(4), compcomm.ErrorFeedback())
    with pytest.raises(TypeError):
        compcomm.compressed_allreduce(torch.randn(4), object())
    with pytest.raises(ValueError, match="unknown backend"):
        compcomm.compressed_allreduce(torch.randn(4), compcomm.ErrorFeedback(), backend="carrier-pigeon")


def test_gloo_without_process_group_names_the_fix():
    with pytest.raises(RuntimeError, match="init_process_group"):
        compcomm.backends.get("gloo")
