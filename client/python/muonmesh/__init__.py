"""muonmesh: a Python client of the muonmesh coordinator.

    import muonmesh
    c = muonmesh.Client()                 # $MUONMESH_COORDINATOR or 127.0.0.1:50051
    job_id = c.submit("job.yaml")         # or a dict, or a JobSpec
    for event in c.watch(job_id): ...     # ends with the job's final state
    c.metrics(job_id)                     # per-step records (a DataFrame with pandas)

See client/python/muonmesh/client.py and the README's "Python client".
"""

from muonmesh.client import DEFAULT_COORDINATOR, FINAL_STATES, PHASES, Client, to_dict
from muonmesh.errors import (AuthError, JobRejected, LimitReached, MuonmeshError, NotFound,
                             Unavailable)
from muonmesh.jobfile import JobFileError

__all__ = [
    "AuthError", "Client", "DEFAULT_COORDINATOR", "FINAL_STATES", "JobFileError", "JobRejected",
    "LimitReached", "MuonmeshError", "NotFound", "PHASES", "Unavailable", "to_dict",
]
