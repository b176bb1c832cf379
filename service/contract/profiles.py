"""Where a job's profiles are, and the event that summarizes one (`JobSpec.profile`).

The trainers write, on every rank, a Chrome trace of the profiled steps (`trainers.profiling`) beside
the checkpoints, in the layout TensorBoard's PyTorch profiler plugin reads (`tensorboard --logdir
{storage}/job-N/profile`; Perfetto opens the files as they are):

    {storage}/job-N/profile/plugins/profile/steps-11-15/rank-0.pt.trace.json
                                                        rank-1.pt.trace.json
                                                        summary.json      # every rank's split

Rank 0 then posts one `profile` event (`PROFILE_EVENT`) whose data holds the window, the folder and
the compute/communication split (means over the ranks, and the rank that spends the largest share
communicating); the service lists a job's profiles from these events (`service.jobs`).
"""

from __future__ import annotations

from service.contract.storage import checkpoint_uri

PROFILE_EVENT = "profile"
PROFILE_DIR = "profile"
# TensorBoard's profiler plugins look for runs under `plugins/profile/` of a logdir.
PLUGIN_DIR = "plugins/profile"
SUMMARY_FILE = "summary.json"
TRACE_SUFFIX = ".pt.trace.json"


def profile_run(*, start_step: int, end_step: int) -> str:
    """The profile's run name (TensorBoard's run): the steps it covers."""
    return f"steps-{start_step}-{end_step}"


def profile_folder(*, storage_uri: str, run_name: str, start_step: int, end_step: int) -> str:
    """The URI of the folder that holds one profile's traces (file:// or s3://)."""
    name = f"{PROFILE_DIR}/{PLUGIN_DIR}/{profile_run(start_step=start_step, end_step=end_step)}"
    return checkpoint_uri(storage_uri=storage_uri, run_name=run_name, name=name)


def trace_name(rank: int) -> str:
    """A rank's trace file: `rank-R.pt.trace.json` (TensorBoard's plugin names the worker `rank-R`)."""
    return f"rank-{rank}{TRACE_SUFFIX}"
