"""``mlx_ssp run``: the whole Spectrum-to-Signal loop from one config, resumably.

Stages, in order (the entries of :data:`STAGE_REGISTRY`, from which the stage list, the sections each
stage's fingerprint covers and the CLI choices all derive), each writing into ``RUN_DIR/<stage>`` in
the format the stage writes on its own:

1. ``tasks``   build the three disjoint splits of every domain (train / probe / eval) as task JSONL.
2. ``rollout`` K rollouts per train prompt from the teacher (default: the model itself), verified.
3. ``select``  diversity-exploring selection of correct solutions -> per-domain SFT data.
4. ``sft``     one LoRA specialist per domain, checkpoint chosen by Pass@K on the probe split, fused.
5. ``merge``   parameter merge of the specialists (VibeThinker: the plain average; any method).
6. ``rl``      MGPO-weighted GRPO on the merged model (VibeThinker-1.5B section 3.4); with ``rl.phases``
               sequential phases, each from the previous one's model (VibeThinker-3B section 2.2.2).
7. ``distill`` (only with a ``distill:`` section) offline self-distillation of the RL checkpoints'
               correct traces into the student (VibeThinker-3B section 2.3; :mod:`mlx_ssp.distill`).
8. ``eval``    pass@1 / pass@k on the held-out split for the base model, every specialist, the merged
               model, the RL model (one row per RL phase) and the distilled student, as one table.

An optional stage (``Stage.section``) whose section the run file lacks is not run and is left out
of the fingerprint chain, so runs made before it existed keep every fingerprint.

Resumability: every stage records a fingerprint of its resolved config (defaults filled in) chained
with the fingerprint of the stage before it, and marks itself complete at the end. A rerun skips
complete stages whose fingerprint matches, continues an incomplete one (the stages resume on their
own: rollouts append, SFT continues from its last checkpoint, RL from its last checkpoint, eval per
model), and when a stage's config changed it says so and reruns that stage and everything after it,
moving the stale outputs to ``RUN_DIR/.stale/`` rather than reusing or deleting them. ``--only``
and ``--from`` force their stage(s): a complete one is rerun, an interrupted one with the same
config resumes (:func:`plan_stage`).

One writer: the driver holds :data:`RUN_LOCK` in the run directory for the whole run, and the output
lock (:func:`mlx_ssp.io.output_lock`) of every stage directory, the one each stage command takes on
its output; a second ``mlx_ssp run`` on the directory, or a stage command writing into one of its
stage directories, fails at once naming the directory and the holder's pid (:func:`lock_run`). A
directory that is neither empty nor a run (no :data:`RUN_MARKER`) is refused (:func:`check_run_dir`).

Deviation from the papers: VibeThinker's Spectrum phase uses a large teacher's distillation data and
its Signal phase runs for thousands of steps on a 1.5B model; here the default teacher is the model
itself (rejection sampling from its own K-rollouts) and the sizes fit a laptop.

The package, by job: :mod:`.runfile` (the run file and its sections), :mod:`.stages` (one function per
stage), :mod:`.registry` (the stage registry and the fingerprints), :mod:`.rundir` (state records,
the run directory's check, locks and config.resolved.yaml), :mod:`.driver` (the plan and the loop),
:mod:`.outputs` (the models a run wrote, cards, upload) and :mod:`.table` (the eval table).
"""

from mlx_ssp.pipeline.driver import plan_stage, run_pipeline, run_stages
from mlx_ssp.pipeline.outputs import eval_models, final_model
from mlx_ssp.pipeline.registry import STAGE_REGISTRY, STAGES, Stage, active_stages, fingerprint
from mlx_ssp.pipeline.rundir import RUN_LOCK, RUN_MARKER, STATE_FILE, check_run_dir, lock_run, prepare_run_dir
from mlx_ssp.pipeline.runfile import SECTIONS, Run, Section, load_run, resolved_config
from mlx_ssp.pipeline.table import eval_table, format_eval_table

__all__ = [
    "RUN_LOCK", "RUN_MARKER", "SECTIONS", "STAGES", "STAGE_REGISTRY", "STATE_FILE", "Run", "Section", "Stage",
    "active_stages", "check_run_dir", "eval_models", "eval_table", "final_model", "fingerprint", "format_eval_table",
    "load_run", "lock_run", "plan_stage", "prepare_run_dir", "resolved_config", "run_pipeline", "run_stages",
]
