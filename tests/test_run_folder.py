"""The run-folder plan (olmo_tda.integrations.run_folder.plan_start): every start case docs/RESUME.md
documents, as a table of (what the folder holds, the flags) -> the start. Then the same cases carried
out by ``olmo-tda train``'s start (``olmo_train._choose_start``) on temporary folders built by hand:
what a resume keeps, what a start over removes, what a refusal leaves as it was."""

from __future__ import annotations

import pytest

from olmo_tda.integrations.run_folder import Flags, Folder, Fresh, Refuse, Resume, plan_start

EMPTY = Folder()
HELD = Folder(run=True, checkpoints=(0, 2))             # a run with checkpoints at steps 0 and 2
ENDED = Folder(run=True, finished=True)                 # a run that ended without any checkpoint
STOPPED = Folder(run=True)                              # stopped before its first checkpoint

CASES = [
    # (case, folder, flags, the start)
    ("a first start", EMPTY, Flags(), Fresh(clear=False, why="")),
    ("a first start of a requeue-ready launch", EMPTY, Flags(latest=True), Fresh(clear=False, why="")),
    ("a first start with save_overwrite", EMPTY, Flags(overwrite=True), Fresh(clear=False, why="")),
    ("requeue / restart: resume the latest", HELD, Flags(latest=True), Resume(2, True, "")),
    ("the latest even with reset flags", HELD, Flags(latest=True, reset=True), Resume(2, True, "")),
    ("the latest even with save_overwrite", HELD, Flags(latest=True, overwrite=True), Resume(2, True, "")),
    ("load_path: the latest", HELD, Flags(load_step=2), Resume(2, True, "")),
    ("load_path: an earlier one, refused", HELD, Flags(load_step=0), Refuse("not the latest checkpoint")),
    ("load_path: an earlier one, save_overwrite", HELD, Flags(load_step=0, overwrite=True), Resume(0, True, "")),
    ("load_path inside + reset: refused", HELD, Flags(load_step=2, reset=True, overwrite=True),
     Refuse("would remove")),
    ("a held folder, no flags: refused", HELD, Flags(), Refuse("--try_load_latest_save")),
    ("a held folder, save_overwrite: start over", HELD, Flags(overwrite=True), Fresh(clear=True, why="")),
    ("load_path elsewhere over a held folder: refused", HELD, Flags(load_outside=True), Refuse("already holds a run")),
    ("load_path elsewhere + save_overwrite: resume it here", HELD, Flags(load_outside=True, overwrite=True),
     Resume(None, True, "")),
    ("reset from elsewhere + save_overwrite: start over", HELD,
     Flags(load_outside=True, reset=True, overwrite=True), Fresh(clear=True, why="")),
    ("an ended run without checkpoints: refused", ENDED, Flags(latest=True), Refuse("ended without saving")),
    ("an ended run, save_overwrite: start over", ENDED, Flags(overwrite=True), Fresh(clear=True, why="")),
    ("stopped before its first checkpoint: start over", STOPPED, Flags(latest=True), Fresh(clear=True, why="")),
    ("stopped, a plain rerun: start over", STOPPED, Flags(), Fresh(clear=True, why="")),
    ("stopped, continued pretraining: resume it again", STOPPED, Flags(load_outside=True), Resume(None, True, "")),
    ("stopped, reset from elsewhere: start over", STOPPED, Flags(load_outside=True, reset=True),
     Fresh(clear=True, why="")),
    ("empty, continued pretraining", EMPTY, Flags(load_outside=True), Resume(None, False, "")),
    ("empty, weights from elsewhere (reset)", EMPTY, Flags(load_outside=True, reset=True), Fresh(clear=False, why="")),
]


@pytest.mark.parametrize("case, folder, flags, want", CASES, ids=[c[0] for c in CASES])
def test_plan_start(case, folder, flags, want):
    got = plan_start(folder, flags)
    assert type(got) is type(want), (case, got)
    if isinstance(want, Refuse):
        assert want.reason in got.reason, (case, got.reason)
    elif isinstance(want, Resume):
        assert (got.step, got.continues) == (want.step, want.continues), (case, got)
    else:
        assert got.clear == want.clear, (case, got)
    assert (got.reason if isinstance(got, Refuse) else got.why)         # every outcome says why
