"""Job files and dicts made ready to submit, as `muonmeshctl submit` makes them.

The coordinator and the workers cannot resolve paths against the client's
folder, so a job read from a file has its relative paths joined to the
file's folder and made absolute, output.dir defaults to
<file's folder>/runs/<name>, and a synthetic model's spec file is read into
model.synthetic.model (client/coordinator_client.h, LoadJobForSubmit).
A dict is taken against the current folder the same way.

Files are parsed by the coordinator's parser when a `parse_text` is given
(muonmesh.Client passes one: Jobs.ParseJobFile, the rules muonmeshctl and
the workers read files with, errors located FILE:LINE:COL), so a file means
the same to every client; without one (offline use) by PyYAML and
protobuf's json_format, which read some YAML differently (`off` as false).
"""

import copy
import os

import yaml
from google.protobuf import json_format

from muonmesh.v1 import config_pb2


class JobFileError(ValueError):
    """A job file that cannot be read or parsed; the message names the file."""


def _read_document(path, what):
    try:
        with open(path, encoding="utf-8") as f:
            doc = yaml.safe_load(f)
    except OSError as e:
        raise JobFileError(f"{path}: cannot read {what}: {e.strerror}") from None
    except yaml.YAMLError as e:
        raise JobFileError(f"{path}: not YAML or JSON: {e}") from None
    if not isinstance(doc, dict):
        raise JobFileError(f"{path}: {what} must be a mapping, not {type(doc).__name__}")
    return doc


def _read_text(path, what):
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except OSError as e:
        raise JobFileError(f"{path}: cannot read {what}: {e.strerror}") from None
    except UnicodeDecodeError as e:
        raise JobFileError(f"{path}: {what} is not UTF-8 text: {e.reason} at byte {e.start}") from None


def _from_file(path, message, what, parse_text):
    """`message` filled from the file at `path` (YAML or JSON)."""
    if parse_text is None:
        return _parse(_read_document(path, what), message, path)
    return parse_text(_read_text(path, what), path, message)


def _parse(doc, message, source):
    try:
        return json_format.ParseDict(doc, message)
    except json_format.ParseError as e:
        raise JobFileError(f"{source}: {e}") from None


def _absolute(base, path):
    return path if os.path.isabs(path) else os.path.normpath(os.path.join(base, path))


def resolve(spec, base, parse_text=None):
    """Makes `spec`'s paths absolute against folder `base` (in place)."""
    if spec.init.WhichOneof("source") == "safetensors":
        spec.init.safetensors = _absolute(base, spec.init.safetensors)
    if spec.init.WhichOneof("source") == "checkpoint":
        spec.init.checkpoint = _absolute(base, spec.init.checkpoint)
    source = spec.data.WhichOneof("source")
    if source == "safetensors":
        spec.data.safetensors = _absolute(base, spec.data.safetensors)
    elif source in ("text", "tokens"):
        corpus = getattr(spec.data, source)
        if corpus.train:
            corpus.train = _absolute(base, corpus.train)
        if corpus.val:
            corpus.val = _absolute(base, corpus.val)
    out = spec.output
    out.dir = _absolute(base, out.dir or os.path.join("runs", spec.name))
    if getattr(out, "export"):
        setattr(out, "export", _absolute(base, getattr(out, "export")))
    if spec.model.WhichOneof("kind") == "synthetic":
        synthetic = spec.model.synthetic
        if not synthetic.HasField("model") and synthetic.spec:
            synthetic.spec = _absolute(base, synthetic.spec)
            _from_file(synthetic.spec, synthetic.model, "model.synthetic.spec", parse_text)
    return spec


def load(job, parse_text=None):
    """A JobSpec from a path (YAML or JSON), a dict, or a JobSpec (copied).
    `parse_text(text, source, message)` fills `message` from a file's text
    (see above)."""
    if isinstance(job, config_pb2.JobSpec):
        return copy.deepcopy(job)
    if isinstance(job, dict):
        spec = _parse(job, config_pb2.JobSpec(), "job")
        return resolve(spec, os.getcwd(), parse_text)
    if isinstance(job, (str, os.PathLike)):
        path = os.fspath(job)
        spec = _from_file(path, config_pb2.JobSpec(), "a job", parse_text)
        return resolve(spec, os.path.dirname(os.path.abspath(path)), parse_text)
    raise TypeError(f"a job is a dict, a path or a JobSpec, not {type(job).__name__}")


def load_model(model, parse_text=None):
    """A ModelSpec (the planner's input) from a path, a dict or a ModelSpec."""
    if isinstance(model, config_pb2.ModelSpec):
        return copy.deepcopy(model)
    if isinstance(model, dict):
        return _parse(model, config_pb2.ModelSpec(), "model")
    if isinstance(model, (str, os.PathLike)):
        path = os.fspath(model)
        return _from_file(path, config_pb2.ModelSpec(), "a model spec", parse_text)
    raise TypeError(f"a model is a dict, a path or a ModelSpec, not {type(model).__name__}")
