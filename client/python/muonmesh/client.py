"""The coordinator's Jobs, Fleet and Planner services for Python programs.

    import muonmesh
    c = muonmesh.Client("127.0.0.1:50051")
    job_id = c.submit("examples/gpt.yaml")
    for event in c.watch(job_id):
        ...
    df = c.metrics(job_id)        # a pandas DataFrame when pandas is installed

Answers are plain Python values: jobs, workers and events are dicts keyed by
the proto field names (snake_case), enums by their short names ("RUNNING",
"IDLE", not JOB_STATE_RUNNING), int64 fields as ints. Refusals raise
muonmesh.MuonmeshError subclasses (muonmesh/errors.py).

Defaults come from the environment as muonmeshctl reads it:
MUONMESH_COORDINATOR (else 127.0.0.1:50051), MUONMESH_TLS_CA,
MUONMESH_TLS_CERT and MUONMESH_TLS_KEY (mutual TLS), MUONMESH_TLS_SERVER_NAME,
MUONMESH_TOKEN_FILE, MUONMESH_TOKEN.
"""

import os
import time
import uuid

import grpc

from muonmesh import errors, jobfile
from muonmesh.v1 import (config_pb2, fleet_pb2, fleet_pb2_grpc, jobs_pb2, jobs_pb2_grpc,
                         planner_pb2, planner_pb2_grpc)

DEFAULT_COORDINATOR = "127.0.0.1:50051"
FINAL_STATES = frozenset({"SUCCEEDED", "FAILED", "CANCELLED"})
# The phases of a step record, in the order of a training step.
PHASES = tuple(f.name for f in jobs_pb2.PhaseSeconds.DESCRIPTOR.fields)

# Prefixes stripped from enum value names in answers.
_ENUM_PREFIX = {"JobState": "JOB_STATE_", "WorkerState": "WORKER_STATE_",
                "AttemptOutcome": "ATTEMPT_OUTCOME_"}
# Most pages one list or metrics call reads before it gives up on the
# coordinator (as muonmeshctl does; a token seen twice stops it too).
_MAX_PAGES = 100000
# Times a stream broken by the coordinator's restart is taken up again.
_WATCH_RETRIES = 30


def _env(name):
    value = os.environ.get(name, "")
    return value or None


def _read(path, what):
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise ValueError(f"{what} {path}: cannot read: {e.strerror}") from None


def _read_token_file(path):
    text = _read(path, "token_file").decode("utf-8", "replace")
    token = text.split("\n", 1)[0].strip()
    if not token or " " in token or "\t" in token:
        raise ValueError(f"token_file {path}: the first line must hold the token alone")
    return token


def to_dict(message):
    """A protobuf message as a dict: every field (unset scalars at their
    defaults, unset messages and oneof members left out), enums by short
    name, int64 as int, repeated fields as lists, maps as dicts."""
    out = {}
    for field in message.DESCRIPTOR.fields:
        value = getattr(message, field.name)
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            value_field = field.message_type.fields_by_name["value"]
            out[field.name] = {k: (to_dict(v) if value_field.message_type else v)
                               for k, v in value.items()}
        elif field.label == field.LABEL_REPEATED:
            out[field.name] = [_value(field, v) for v in value]
        elif field.message_type is not None or field.containing_oneof is not None or \
                field.has_presence:
            if message.HasField(field.name):
                out[field.name] = _value(field, value)
        else:
            out[field.name] = _value(field, value)
    return out


def _value(field, value):
    if field.message_type is not None:
        return to_dict(value)
    if field.enum_type is not None:
        name = field.enum_type.values_by_number[value].name if \
            value in field.enum_type.values_by_number else str(value)
        prefix = _ENUM_PREFIX.get(field.enum_type.name, "")
        return name[len(prefix):] if name.startswith(prefix) else name
    return value


def _step_row(record):
    """A step record as one flat dict: step, rank, loss, step_seconds, the
    phases by name, val_loss (None when not evaluated), grad_norm (before
    clipping), lr_scale (the schedule's multiplier), attempt, ns_flops,
    bytes_sent (a dict), max_attn_logit (a list, one per layer; empty
    without attention), and Muon's health: muon_matrices,
    muon_planned_matrices, muon_elements, muon_planned_elements,
    muon_update_rms, muon_ortho_error_max and muon_ortho_error_median (None
    off the health steps), and expert_load (a list of dicts, one per
    mixture-of-experts layer: layer, min_over_mean, max_over_mean, dropped;
    empty without experts) with aux_loss (the balance loss's part of loss,
    None without one)."""
    row = {"step": record.step, "rank": record.rank, "loss": record.loss,
           "step_seconds": record.step_seconds}
    for phase in PHASES:
        row[phase] = getattr(record.phases, phase)
    row["val_loss"] = record.val_loss if record.HasField("val_loss") else None
    row["grad_norm"] = record.grad_norm
    row["lr_scale"] = record.lr_scale
    row["attempt"] = record.attempt
    row["ns_flops"] = record.ns_flops
    row["bytes_sent"] = dict(record.bytes_sent)
    row["max_attn_logit"] = list(record.max_attn_logit)
    row["aux_loss"] = record.aux_loss if record.HasField("aux_loss") else None
    row["expert_load"] = [{"layer": e.layer, "min_over_mean": e.min_over_mean,
                           "max_over_mean": e.max_over_mean, "dropped": e.dropped}
                          for e in record.expert_load]
    health = record.muon
    for field in ("matrices", "planned_matrices", "elements", "planned_elements", "update_rms"):
        row["muon_" + field] = getattr(health, field)
    for field in ("ortho_error_max", "ortho_error_median"):
        row["muon_" + field] = getattr(health, field) if health.HasField(field) else None
    return row


class Client:
    """A client of one coordinator. Thread-safe; calls are independent.

    Args:
      address: HOST:PORT; default $MUONMESH_COORDINATOR, else 127.0.0.1:50051.
      tls: the CA certificate file (PEM) that signed the coordinator's
        certificate; True: the system's CAs; False: plaintext; None:
        $MUONMESH_TLS_CA if set, else plaintext.
      token: a bearer token; default: the first line of `token_file`
        ($MUONMESH_TOKEN_FILE), else $MUONMESH_TOKEN. Needs TLS: tokens never
        travel in plaintext.
      token_file: a file whose first line is the token.
      tls_cert, tls_key: a client certificate and its key (mutual TLS);
        default $MUONMESH_TLS_CERT / $MUONMESH_TLS_KEY.
      server_name: the name to check the coordinator's certificate against,
        when it is not the address's host ($MUONMESH_TLS_SERVER_NAME).
      timeout: seconds each call may take (watch and the paging of list and
        metrics run longer: each of their calls gets this).
    """

    def __init__(self, address=None, *, tls=None, token=None, token_file=None, tls_cert=None,
                 tls_key=None, server_name=None, timeout=30.0):
        self.address = address or _env("MUONMESH_COORDINATOR") or DEFAULT_COORDINATOR
        self.timeout = timeout
        if tls is None:
            tls = _env("MUONMESH_TLS_CA") or False
        token_file = token_file or (None if token else _env("MUONMESH_TOKEN_FILE"))
        if token is None and token_file:
            token = _read_token_file(token_file)
        if token is None:
            token = _env("MUONMESH_TOKEN")
        tls_cert = tls_cert or _env("MUONMESH_TLS_CERT")
        tls_key = tls_key or _env("MUONMESH_TLS_KEY")
        server_name = server_name or _env("MUONMESH_TLS_SERVER_NAME")
        self._channel = self._open_channel(tls, token, tls_cert, tls_key, server_name)
        self._jobs = jobs_pb2_grpc.JobsStub(self._channel)
        self._fleet = fleet_pb2_grpc.FleetStub(self._channel)
        self._planner = planner_pb2_grpc.PlannerStub(self._channel)

    def _open_channel(self, tls, token, tls_cert, tls_key, server_name):
        options = [("grpc.max_receive_message_length", 1 << 30)]
        if tls is False:
            if token:
                raise ValueError("a token needs TLS (tokens never travel in plaintext): "
                                 "give tls=CA_FILE or set MUONMESH_TLS_CA")
            if tls_cert or tls_key:
                raise ValueError("a client certificate needs TLS: give tls=CA_FILE")
            return grpc.insecure_channel(self.address, options=options)
        if bool(tls_cert) != bool(tls_key):
            raise ValueError("tls_cert and tls_key go together (a certificate and its key)")
        root = None if tls is True else _read(os.fspath(tls), "tls (the CA file)")
        credentials = grpc.ssl_channel_credentials(
            root_certificates=root,
            private_key=_read(tls_key, "tls_key") if tls_key else None,
            certificate_chain=_read(tls_cert, "tls_cert") if tls_cert else None)
        if token:
            credentials = grpc.composite_channel_credentials(
                credentials, grpc.access_token_call_credentials(token))
        if server_name:
            options.append(("grpc.ssl_target_name_override", server_name))
        return grpc.secure_channel(self.address, credentials, options=options)

    def close(self):
        self._channel.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _call(self, method, request, what, timeout=None):
        try:
            return method(request, timeout=timeout or self.timeout)
        except grpc.RpcError as e:
            raise errors.from_rpc_error(e, what) from None

    # Jobs.

    def _parse_text(self, text, source, message):
        """`message` (a JobSpec or ModelSpec) from a file's text, parsed by
        the coordinator (Jobs.ParseJobFile): the rules muonmeshctl reads
        files with. Raises jobfile.JobFileError with its FILE:LINE:COL."""
        model_spec = isinstance(message, config_pb2.ModelSpec)
        request = jobs_pb2.ParseJobFileRequest(text=text, source_name=source,
                                               model_spec=model_spec)
        try:
            response = self._jobs.ParseJobFile(request, timeout=self.timeout)
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.INVALID_ARGUMENT:
                raise jobfile.JobFileError(e.details()) from None
            raise errors.from_rpc_error(e, f"parse {source}") from None
        message.CopyFrom(response.model_spec if model_spec else response.job)
        return message

    def _submit_spec(self, spec, request_id):
        request = jobs_pb2.SubmitJobRequest(request_id=request_id or str(uuid.uuid4()), spec=spec)
        for attempt in range(3):
            try:
                return self._call(self._jobs.SubmitJob, request, "submit").job.id
            except errors.Unavailable:
                if attempt == 2:
                    raise
                time.sleep(0.5 * (attempt + 1))
        raise AssertionError("unreachable")

    def submit(self, job, request_id=None):
        """Submits a job: a path to a YAML or JSON job file, a dict of the
        same, or a JobSpec. Returns the job's id.

        `request_id` makes the submit idempotent: submitting again with the
        same id returns the first job instead of making another. Without
        one a fresh id is made, so a retry after a lost answer (done here on
        UNAVAILABLE) makes no second job. Raises JobRejected, with every
        violation, for a job the coordinator refuses."""
        return self._submit_spec(jobfile.load(job, self._parse_text), request_id)

    def resume(self, job_id, world_size=None, request_id=None):
        """Submits the job again from the newest complete checkpoint in its
        output folder (init: {checkpoint: <output.dir>}, any other init
        dropped), at `world_size` ranks when given, as `muonmeshctl resume`
        does; returns the new job's id. The job must have ended (cancel it
        first, with checkpoint=True to keep its last step)."""
        earlier = self._call(self._jobs.GetJob, jobs_pb2.GetJobRequest(job_id=job_id),
                             f"resume {job_id}")
        spec = config_pb2.JobSpec()
        spec.CopyFrom(earlier.spec)
        if not spec.output.dir:
            raise errors.MuonmeshError(
                grpc.StatusCode.INVALID_ARGUMENT,
                "output.dir: the job has no output folder, so no checkpoint to resume from",
                call=f"resume {job_id}")
        spec.ClearField("init")
        spec.init.checkpoint = spec.output.dir
        if world_size:
            spec.world_size = world_size
        return self._submit_spec(spec, request_id)

    def get(self, job_id):
        """The job as a dict (state, reason, steps_done, last_loss, ...)."""
        return to_dict(self._call(self._jobs.GetJob, jobs_pb2.GetJobRequest(job_id=job_id),
                                  f"get {job_id}"))

    def list(self, states=(), name="", full_spec=False):
        """Every job (newest first), or those in `states` ("RUNNING", ...)
        and named `name`; their specs only with full_spec."""
        request = jobs_pb2.ListJobsRequest(
            states=[jobs_pb2.JobState.Value(s if s.startswith("JOB_STATE_") else
                                            "JOB_STATE_" + s) for s in states],
            name=name, full_spec=full_spec)
        jobs = []
        for page in self._pages(self._jobs.ListJobs, request, "list"):
            jobs.extend(to_dict(j) for j in page.jobs)
        return jobs

    def cancel(self, job_id, reason="", checkpoint=False):
        """Cancels a job; returns it as a dict (CANCELLED). With checkpoint,
        its ranks first finish their current step and checkpoint it (for
        resume); cancelling again without it stops them at once."""
        return to_dict(self._call(self._jobs.CancelJob,
                                  jobs_pb2.CancelJobRequest(job_id=job_id, reason=reason,
                                                            checkpoint=checkpoint),
                                  f"cancel {job_id}"))

    def delete(self, job_id):
        """Deletes a finished job and its records."""
        self._call(self._jobs.DeleteJob, jobs_pb2.DeleteJobRequest(job_id=job_id),
                   f"delete {job_id}")

    def watch(self, job_id, from_index=1, timeout=None):
        """The job's events from `from_index` on, live, as dicts ({"index",
        "unix_ms", and "state_change" or "step"}); the iterator ends after
        the event that puts the job in a final state. A stream broken by a
        coordinator restart is taken up from the last event seen, without
        gaps or repeats; to resume later, pass the last index seen plus 1.
        `timeout`: seconds in all (None: until the job ends)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        next_index, retries = from_index, 0
        while True:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            request = jobs_pb2.WatchJobRequest(job_id=job_id, from_index=next_index)
            try:
                for event in self._jobs.WatchJob(request, timeout=left):
                    retries = 0
                    next_index = event.index + 1
                    out = to_dict(event)
                    yield out
                    change = out.get("state_change")
                    if change is not None and change["state"] in FINAL_STATES:
                        return
                # The coordinator ended the stream: the job has ended (its
                # last events were read), or it is restarting.
                if self.get(job_id)["state"] in FINAL_STATES:
                    return
            except grpc.RpcError as e:
                error = errors.from_rpc_error(e, f"watch {job_id}")
                if e.code() != grpc.StatusCode.UNAVAILABLE or retries >= _WATCH_RETRIES:
                    raise error from None
                retries += 1
                time.sleep(min(2.0, 0.1 * 2 ** retries))

    def wait(self, job_id, timeout=None):
        """Waits for the job to end; returns it as a dict."""
        for _ in self.watch(job_id, timeout=timeout):
            pass
        return self.get(job_id)

    def metrics(self, job_id, first_step=0, last_step=-1, all_ranks=False, frame=None):
        """The job's per-step records: one row a step (rank 0's, or every
        rank's with all_ranks) with step, rank, loss, step_seconds, each
        phase's seconds (PHASES), val_loss, grad_norm, lr_scale, attempt,
        ns_flops, bytes_sent, max_attn_logit and the muon_* health fields.
        A pandas DataFrame when pandas is installed (frame=None) or asked
        for (frame=True), else a list of dicts."""
        request = jobs_pb2.GetJobMetricsRequest(job_id=job_id, first_step=first_step,
                                                last_step=last_step, all_ranks=all_ranks)
        rows = []
        for page in self._pages(self._jobs.GetJobMetrics, request, f"metrics {job_id}"):
            rows.extend(_step_row(r) for r in page.records)
        if frame is False:
            return rows
        try:
            import pandas
        except ImportError:
            if frame:
                raise
            return rows
        return pandas.DataFrame(rows, columns=list(_step_row(jobs_pb2.StepRecord()).keys()))

    def _pages(self, method, request, what):
        seen = set()
        for _ in range(_MAX_PAGES):
            page = self._call(method, request, what)
            yield page
            token = page.next_page_token
            if not token:
                return
            if token in seen:
                raise errors.MuonmeshError(grpc.StatusCode.DATA_LOSS,
                                           f"the coordinator sent page token {token!r} twice",
                                           call=what)
            seen.add(token)
            request.page_token = token
        raise errors.MuonmeshError(grpc.StatusCode.DATA_LOSS,
                                   f"more than {_MAX_PAGES} pages", call=what)

    # Fleet.

    def workers(self):
        """Every worker the coordinator knows, as dicts (id, state, ...)."""
        return [to_dict(w) for w in self._call(self._fleet.ListWorkers,
                                               fleet_pb2.ListWorkersRequest(), "workers").workers]

    def drain(self, worker_id, reason=""):
        """Takes a worker out of service (admin); its job moves elsewhere."""
        return to_dict(self._call(self._fleet.DrainWorker,
                                  fleet_pb2.DrainWorkerRequest(worker_id=worker_id, reason=reason),
                                  f"drain {worker_id}"))

    def remove_worker(self, worker_id):
        """Forgets a LOST worker (admin), as muonmeshctl workers remove does.

        Raises NotFound for an unknown worker and MuonmeshError
        (FAILED_PRECONDITION) for a live one: drain it and stop it first.
        """
        self._call(self._fleet.RemoveWorker, fleet_pb2.RemoveWorkerRequest(worker_id=worker_id),
                   f"workers remove {worker_id}")

    def remove_lost_workers(self):
        """Forgets every worker listed LOST (admin); returns their ids.

        One that is gone meanwhile, or registered again, is left out.
        """
        removed = []
        for w in self.workers():
            if w["state"] != "LOST":
                continue
            try:
                self.remove_worker(w["info"]["worker_id"])
            except errors.NotFound:
                continue
            except errors.MuonmeshError as e:
                if e.code != grpc.StatusCode.FAILED_PRECONDITION:
                    raise
                continue
            removed.append(w["info"]["worker_id"])
        return removed

    # Planner.

    def _config(self, request_type, model, world_size, parallelism, options):
        request = request_type(model=jobfile.load_model(model, self._parse_text),
                               world_size=world_size)
        if parallelism:
            request.parallelism.CopyFrom(jobfile._parse(dict(parallelism),
                                                        config_pb2.ParallelismConfig(),
                                                        "parallelism"))
        if options:
            request.options.CopyFrom(jobfile._parse(dict(options), planner_pb2.PlanOptions(),
                                                    "options"))
        return request

    def validate(self, model, world_size, parallelism=None, options=None):
        """The violations (a list of (field, description), empty when valid)
        of running `model` (a model spec: path, dict or ModelSpec) on
        `world_size` ranks with `parallelism` (a dict of ParallelismConfig)."""
        request = self._config(planner_pb2.ValidateConfigRequest, model, world_size,
                               parallelism, options)
        answer = self._call(self._planner.ValidateConfig, request, "validate")
        return [(v.field, v.description) for v in answer.violations]

    def plan(self, model, world_size, parallelism=None, options=None, include_holders=False):
        """The plan (meshes, units, shard layouts, Muon owners) as a dict;
        JobRejected for a config the planner refuses. Each matrix's holders
        only with include_holders (most of a large plan's answer)."""
        request = self._config(planner_pb2.PlanLayoutRequest, model, world_size, parallelism,
                               options)
        request.omit_holders = not include_holders
        return to_dict(self._call(self._planner.PlanLayout, request, "plan"))
