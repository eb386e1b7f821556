"""One rank's fault fails every rank loudly, never an NCCL-style hang (forward/agreement.py).

On N = 2, 3, 4 gloo ranks of the installed release's CP rig, each rank-local check of the
forward path is made to fail on ONE rank by real means (sglang_cp_shared_kv_testing/rank_faults.py says how);
every rank must then raise the same ``CpSharedKVRankFault``, naming that rank and the check,
within seconds, and meet the others at a barrier afterwards. A hot-path kernel that raises
on one rank must leave the forward bit-exact and make every rank run its reference from
the next forward on, counted once per rank. The control shows what the checks did before
the agreement point: one rank raising inside a hook leaves the others waiting in a
collective, and the run's deadline (not a hung CI) catches it.
"""

import pytest

from sglang_cp_shared_kv.releases import installed
from sglang_cp_shared_kv.forward.agreement import CHECKS
from sglang_cp_shared_kv_testing.rank_faults import CASES, UNAGREED_RAISE, cases_for, run_fault_cases

RELEASE = installed.INSTALLED.name
#: NOTE: seconds from the faulted forward's start to the raise, on every rank: a two-layer
#: rig forward takes well under a second alone; the bound leaves room for a CI machine's two
#: cores shared by four rank processes, and is far below any collective's timeout (300 s)
RAISE_BOUND_S = 30.0


@pytest.fixture(scope="module", params=[2, 3, 4], ids=lambda n: f"N{n}")
def outcomes(request, tiny_nsa_model):
    n = request.param
    names = [case.name for case in cases_for(RELEASE)]
    per_rank = run_fault_cases(n, RELEASE, names, model_dir=tiny_nsa_model, timeout_s=600)
    return n, {name: [rank["cases"][name] for rank in per_rank] for name in names}


def test_every_rank_local_check_has_a_case():
    """Each check of ``CHECKS`` is tripped by some case (on the release where it exists)."""
    assert {name for name, _ in CHECKS} == {case.check for case in CASES if case.check}


@pytest.mark.parametrize("case", [c for c in cases_for(RELEASE) if c.check], ids=lambda c: c.name)
def test_one_ranks_fault_fails_every_rank_with_the_same_error(outcomes, case):
    n, results = outcomes
    ranks = results[case.name]
    faulty = ranks[0]["faulty_rank"]
    for rank, outcome in enumerate(ranks):
        assert outcome["raised"] == "CpSharedKVRankFault", (rank, outcome)
        assert outcome["seconds"] < RAISE_BOUND_S, (rank, outcome["seconds"])
    messages = {outcome["message"] for outcome in ranks}
    assert len(messages) == 1, messages
    (message,) = messages
    assert f"CP rank {faulty} of {n}: check '{case.check}' failed" in message
    others = [r for r in range(n) if r != faulty]
    assert not any(f"CP rank {r} of {n}: check" in message for r in others), message


@pytest.mark.parametrize("case", [c for c in cases_for(RELEASE) if c.disagreement], ids=lambda c: c.name)
def test_ranks_that_disagree_fail_together_before_their_collectives_differ(outcomes, case):
    """Debug mode: a rank that would size its gathers, or decide its local writes, unlike the
    others fails the forward on every rank, at the agreement before those collectives."""
    n, results = outcomes
    ranks = results[case.name]
    assert all(outcome["raised"] == "CpSharedKVRankFault" for outcome in ranks), ranks
    (message,) = {outcome["message"] for outcome in ranks}
    assert case.disagreement in message and "check '" not in message, message


@pytest.mark.parametrize("case", [c for c in cases_for(RELEASE) if c.kernel], ids=lambda c: c.name)
def test_a_kernel_failing_on_one_rank_falls_back_on_every_rank(outcomes, case):
    n, results = outcomes
    ranks = results[case.name]
    faulty = ranks[0]["faulty_rank"]
    for rank, outcome in enumerate(ranks):
        assert outcome["raised"] is None, (rank, outcome)
        assert outcome["errors"] == [], (rank, outcome["errors"])  # the forward stayed bit-exact
        assert outcome["failed_after_first"] == [case.kernel], (rank, outcome)
        assert outcome["eligible_second"] == 0, (rank, outcome)  # tried nowhere after the agreement
        assert outcome["counted"] == 1.0, (rank, outcome)
    assert ranks[faulty]["eligible_first"] >= 1  # it did run (and raise) on the faulty rank


def test_a_rank_raising_before_a_collective_hangs_the_group_and_the_deadline_catches_it(tiny_nsa_model):
    """The control: what the agreement point prevents, and proof that this file's runs fail
    (rather than hang) when a rank is left in a collective."""
    with pytest.raises(RuntimeError, match="deadline of 45s passed"):
        run_fault_cases(2, RELEASE, [UNAGREED_RAISE.name], model_dir=tiny_nsa_model, timeout_s=45)
