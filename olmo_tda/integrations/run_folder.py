"""How a run starts in its folder: one pure function, :func:`plan_start`, from what the folder holds
(:class:`Folder`) and the flags given (:class:`Flags`) to :class:`Fresh`, :class:`Resume` or
:class:`Refuse`. The integrations read the folder, ask the plan, and carry it out; the rules live here
alone, in a table a reader can check (docs/RESUME.md, tests/test_run_folder.py).

The rules, in order:

1. ``try_load_latest_save`` with a checkpoint in the folder resumes the latest one, whatever else is
   set (a requeued job reruns its command unchanged, and resuming removes and overwrites nothing).
2. A ``load_path`` inside the folder resumes that checkpoint if it is the latest; an earlier one needs
   ``save_overwrite`` (its later checkpoints will be overwritten); ``reset_trainer_state`` with it is
   refused (a fresh start there would remove the checkpoint it loads).
3. A folder whose run has a checkpoint or recorded its end *holds a run*: any other start needs
   ``save_overwrite``, and then clears that run's checkpoints and TDA outputs first (a ``load_path``
   elsewhere without ``reset_trainer_state`` resumes that checkpoint's run into the folder instead).
4. A folder whose run neither saved a checkpoint nor ended was stopped before its first checkpoint
   (a preemption, a crash, a requeue or restart of its launch): nothing of it can be resumed, so any
   start starts it over, clearing its outputs first.
5. An empty folder starts fresh.

Example::

    from olmo_tda.integrations.run_folder import Flags, Folder, plan_start
    print(plan_start(Folder(run=True, checkpoints=(100, 200)), Flags(latest=True)))
    # Resume(step=200, continues=True, why="try_load_latest_save: the folder's latest checkpoint, step 200")
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Folder", "Flags", "Fresh", "Resume", "Refuse", "plan_start"]


@dataclass(frozen=True)
class Folder:
    """What a run folder holds, as far as the start is concerned."""

    run: bool = False
    """A run was started here (its config, or stored rows)."""
    checkpoints: tuple[int, ...] = ()
    """The steps of the run's training checkpoints in the folder."""
    finished: bool = False
    """The run recorded its end."""


@dataclass(frozen=True)
class Flags:
    """The start's flags (OLMo's names)."""

    load_step: int | None = None
    """``load_path`` is a checkpoint of this folder, at this step."""
    load_outside: bool = False
    """``load_path`` is a checkpoint elsewhere (continued pretraining, a warm start)."""
    latest: bool = False
    """``try_load_latest_save``."""
    overwrite: bool = False
    """``save_overwrite``."""
    reset: bool = False
    """``reset_trainer_state``: take ``load_path``'s weights and start a new run from step 0."""


@dataclass(frozen=True)
class Fresh:
    """Start at step 0 (from ``load_path``'s weights with ``reset_trainer_state``)."""

    clear: bool
    """Remove the folder's old run's checkpoints and TDA outputs first."""
    why: str


@dataclass(frozen=True)
class Resume:
    """Restore a checkpoint: ``step`` of the folder's own, or ``load_path`` elsewhere (``step`` None)."""

    step: int | None
    continues: bool
    """The folder's run goes on (its data-order folder is reused)."""
    why: str


@dataclass(frozen=True)
class Refuse:
    reason: str


def plan_start(folder: Folder, flags: Flags) -> Fresh | Resume | Refuse:
    """The start the rules in this module's docstring give for ``folder`` and ``flags``."""
    latest = max(folder.checkpoints, default=None)
    if flags.latest and latest is not None:
        return Resume(latest, True, f"try_load_latest_save: the folder's latest checkpoint, step {latest}")
    if flags.load_step is not None:
        if flags.reset:
            return Refuse("load_path is a checkpoint of the run in this folder, which a fresh start "
                          "(reset_trainer_state) would remove: start the new run in another save_folder")
        if latest is None or flags.load_step >= latest:
            return Resume(flags.load_step, True, f"load_path: the folder's latest checkpoint, step {flags.load_step}")
        if not flags.overwrite:
            return Refuse(f"load_path is step {flags.load_step}, not the latest checkpoint of the run in this folder "
                          f"(step {latest}): resuming it would overwrite the later ones; pass --save_overwrite to "
                          "allow that, or --try_load_latest_save to resume the latest")
        return Resume(flags.load_step, True, f"load_path: step {flags.load_step}; the later checkpoints will be "
                                              "overwritten (save_overwrite)")
    held = folder.run and (latest is not None or folder.finished)
    if held and not flags.overwrite:
        if latest is None:
            return Refuse("the folder holds a run that ended without saving a checkpoint: pass --save_overwrite to "
                          "start it over (its TDA outputs are removed), or use another save_folder")
        return Refuse("the folder already holds a run: pass --try_load_latest_save to resume it from its latest "
                      "checkpoint, or --save_overwrite to start it over (its checkpoints and TDA outputs are removed)")
    stopped = folder.run and not held
    if flags.load_outside and not flags.reset:
        if stopped:
            return Resume(None, True, "the folder's run stopped before its first checkpoint: starting it over from "
                                      "load_path (its rows past that step are cut)")
        return Resume(None, folder.run, "load_path: a checkpoint outside the folder" +
                      (" (the folder's rows past its step are cut)" if folder.run else ""))
    if stopped:
        return Fresh(True, "the folder's run stopped before its first checkpoint: starting it over")
    if held:
        return Fresh(True, "save_overwrite: starting over the folder's run")
    return Fresh(False, "a new run")
