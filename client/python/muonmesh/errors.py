"""Errors of the muonmesh client: one exception type per kind of answer.

Every call that the coordinator refuses raises a MuonmeshError (or one of
its subclasses) carrying the gRPC status code, the coordinator's message and,
for a refused job or config, every field violation it listed (the
google.rpc.BadRequest details of the answer).
"""

import grpc

from google.rpc import error_details_pb2, status_pb2


class MuonmeshError(Exception):
    """The coordinator refused a call, or could not be reached.

    Attributes:
      code: the grpc.StatusCode of the answer.
      message: the coordinator's message.
      violations: a list of (field, description) pairs, empty unless the
        coordinator named the fields it refused.
      call: what the client was doing ("submit", "get j-4", ...).
    """

    def __init__(self, code, message, violations=(), call=""):
        self.code = code
        self.message = message
        self.violations = list(violations)
        self.call = call
        text = f"{call}: {message}" if call else message
        if self.violations and not any(f in message for f, _ in self.violations):
            text += "".join(f"\n  {f}: {d}" for f, d in self.violations)
        super().__init__(text)


class JobRejected(MuonmeshError):
    """INVALID_ARGUMENT: the job or config is wrong; `violations` says where."""


class NotFound(MuonmeshError):
    """NOT_FOUND: no such job (or it was deleted)."""


class AuthError(MuonmeshError):
    """UNAUTHENTICATED or PERMISSION_DENIED: a missing, wrong or weak token."""


class Unavailable(MuonmeshError):
    """UNAVAILABLE or DEADLINE_EXCEEDED: the coordinator did not answer."""


class LimitReached(MuonmeshError):
    """RESOURCE_EXHAUSTED: a bound of the coordinator (jobs per client, ...)."""


_BY_CODE = {
    grpc.StatusCode.INVALID_ARGUMENT: JobRejected,
    grpc.StatusCode.NOT_FOUND: NotFound,
    grpc.StatusCode.UNAUTHENTICATED: AuthError,
    grpc.StatusCode.PERMISSION_DENIED: AuthError,
    grpc.StatusCode.UNAVAILABLE: Unavailable,
    grpc.StatusCode.DEADLINE_EXCEEDED: Unavailable,
    grpc.StatusCode.RESOURCE_EXHAUSTED: LimitReached,
}


def _violations(rpc_error):
    """The BadRequest field violations in an answer's trailing metadata."""
    trailing = rpc_error.trailing_metadata() or ()
    for key, value in trailing:
        if key != "grpc-status-details-bin":
            continue
        status = status_pb2.Status()
        try:
            status.ParseFromString(value)
        except Exception:  # a malformed detail is not worth hiding the error
            return []
        out = []
        for detail in status.details:
            if detail.Is(error_details_pb2.BadRequest.DESCRIPTOR):
                bad = error_details_pb2.BadRequest()
                detail.Unpack(bad)
                out.extend((v.field, v.description) for v in bad.field_violations)
        return out
    return []


def from_rpc_error(rpc_error, call=""):
    """The MuonmeshError subclass for a grpc.RpcError."""
    code = rpc_error.code()
    cls = _BY_CODE.get(code, MuonmeshError)
    return cls(code, rpc_error.details() or str(code), _violations(rpc_error), call)
