"""spec.managedBy and Kueue's MultiKueue: who runs an RLJob, and where its Workload comes from.

MultiKueue (Kueue >= 0.15, its generic adapter for external frameworks: `multiKueue.externalFrameworks` naming
`RLJob.v1alpha1.r3operator.io`) dispatches a job from a manager cluster to a worker cluster:

- on the manager, the RLJob carries `spec.managedBy: kueue.x-k8s.io/multikueue`; this operator is its job
  controller only as far as Kueue needs one: it creates the RLJob's Workload (controlled by the RLJob, so that the
  adapter finds the job) and nothing else: no child, no status write. Kueue reserves quota, its MultiKueue
  admission check copies the Workload to the workers, and once one worker reserves quota it creates a copy of the
  RLJob there (without `managedBy`, labelled `kueue.x-k8s.io/prebuilt-workload-name`) and from then on copies the
  worker's RLJob status into the manager's, whole;
- on the worker, the RLJob is an ordinary one whose Workload already exists (the copy, which names no owner):
  the operator reads its admission from that Workload and plays the job controller's part on it (release on
  eviction, Finished at the end, which MultiKueue carries back to the manager) instead of creating its own.

Any other `managedBy` belongs to another controller: the operator leaves such a job alone.
"""

from __future__ import annotations

from r3operator.api.v1alpha1 import MANAGED_BY_MULTIKUEUE, MANAGED_BY_OPERATOR, RLJob

PREBUILT_WORKLOAD_LABEL = "kueue.x-k8s.io/prebuilt-workload-name"
"""Set by MultiKueue on the copy of a job it creates on a worker: the Workload to use (Kueue's constants)."""
MULTIKUEUE_ORIGIN_LABEL = "kueue.x-k8s.io/multikueue-origin"


def managed_here(job: RLJob) -> bool:
    """This operator runs the job: `managedBy` unset or `r3operator.io/operator`."""
    return job.spec.managed_by in (None, MANAGED_BY_OPERATOR)


def dispatched_by_multikueue(job: RLJob) -> bool:
    """The manager's copy of a job MultiKueue runs on a worker: only its Workload is made here."""
    return job.spec.managed_by == MANAGED_BY_MULTIKUEUE


def prebuilt_workload(job: RLJob) -> str | None:
    """The Workload MultiKueue made for this job on a worker cluster (None: the operator makes its own)."""
    if job.spec.queue_name is None:
        return None
    return job.metadata.labels.get(PREBUILT_WORKLOAD_LABEL) or None
