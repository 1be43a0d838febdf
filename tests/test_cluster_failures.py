"""The cause of a worker's death as ``cluster.failures.death_cause`` reads it from Ray's messages
(the texts of ``ray.exceptions.ActorDiedError.error_msg``, Ray 2.x)."""

import pytest

from rollplex_train.cluster.failures import WorkerFailure, death_cause

KILLED = ("The actor died unexpectedly before finishing this task.\n\tclass_name: TrainWorker\n"
          "The actor is dead because its worker process has died. Worker exit type: SYSTEM_ERROR Worker exit detail: "
          "Worker unexpectedly exits with a connection error code 2. End of file. Some common causes include: (1) "
          "the process was killed by the OOM killer due to high memory usage, (2) ray stop --force was called, or "
          "(3) the worker crashed unexpectedly due to SIGSEGV or another unexpected error.")
OOM = ("The actor died unexpectedly before finishing this task.\nWorker exit type: NODE_OUT_OF_MEMORY Worker exit "
       "detail: Task was killed due to the node running low on memory.")


@pytest.mark.parametrize("message, cause", [
    (KILLED, "killed by a signal (SIGKILL, the kernel's OOM killer or a crash: its process exited without a reply)"),
    (OOM, "out of memory (Ray's memory monitor killed it)"),
    ("The actor died unexpectedly before finishing this task.\nkilled by SIGTERM", "killed by signal SIGTERM"),
])
def test_death_cause(message, cause):
    assert death_cause(message) == cause


def test_failure_line_names_role_and_rank():
    assert str(WorkerFailure("train", 1, "killed by signal SIGKILL")) == "train worker rank 1 failed: killed by signal SIGKILL"
