#!/usr/bin/env node
// The Kubernetes deployment with TLS (deploy/k8s/components/tls), run on
// loopback from its own manifests, since no cluster runs here. Inputs: the
// cpu overlay with the component rendered by `kubectl kustomize`
// (tests/deploy/observe/tls-overlay), and the Secrets that
// deploy/k8s/make-secrets.sh makes, caught by a stand-in `kubectl` on its
// PATH that keeps what `kubectl apply -f -` is given and runs the real
// kubectl for the rest (`create ... --dry-run=client -o yaml`).
//
// Every pod of the rendered coordinator Deployment, worker StatefulSet and
// submit Job then runs as a local process: the container's command (its
// binary from this build), args and env as rendered ($(VAR) expanded; the
// pod's name and 127.0.0.1 for the fieldRefs), as the pod's runAsUser when
// this runs as root. Each volume is a local folder standing for its
// mountPath: Secrets and ConfigMaps written out with their modes (with an
// fsGroup, group-readable by it, as the kubelet does), a PersistentVolumeClaim
// one folder shared by the pods that claim it, an emptyDir one per pod.
// Container paths in args, workingDir and the ConfigMaps' files are mapped to
// those folders; a listen address on a containerPort moves to a free loopback
// port; SERVICE:PORT is dialled at the port of the pod the Service selects,
// with the TLS server name the pod would verify there
// (MUONMESH_TLS_SERVER_NAME=SERVICE).
//
// Checked:
//   1. the coordinator's certificate names the Service the pods dial;
//   2. the StatefulSet's workers register over mutual TLS with the worker
//      token; the submit Job submits the example job with the submitter
//      token, and it runs on them to SUCCEEDED, its export written;
//   3. a viewer token reads it; a client without a token, a plaintext
//      client and a viewer submitting are refused; a worker without the
//      client certificate is not let in.
//
//   tls_deploy.mjs --rendered FILE --make-secrets SCRIPT --coordinator BIN
//                  --worker BIN --ctl BIN --modules DIR [--out DIR] [--timeout 240]
// Exit 0: all passed; 1: a check failed (named on stderr); 2: usage; 77:
// openssl or the rendered file is missing.

import { spawnSync } from 'node:child_process';
import { createRequire } from 'node:module';
import fs from 'node:fs';
import os from 'node:os';
import path from 'node:path';

import { fail, failures, finish, loadYamlDocuments, skip } from './lib/common.mjs';
import { Processes, freePort, until as untilOr } from './lib/processes.mjs';

// ------------------------------------------------------------------ options

const flags = ['rendered', 'make-secrets', 'coordinator', 'worker', 'ctl', 'modules', 'out', 'timeout'];
const opts = { timeout: 240 };
for (let i = 2; i < process.argv.length; i += 2) {
  const key = process.argv[i].replace(/^--/, '');
  if (!flags.includes(key) || process.argv[i + 1] === undefined) usage(`bad flag ${process.argv[i]}`);
  opts[key] = key === 'timeout' ? Number(process.argv[i + 1]) : process.argv[i + 1];
}
for (const f of flags.slice(0, 6)) if (!opts[f]) usage(`--${f} is required`);

function usage(problem) {
  console.error(`tls_deploy.mjs: ${problem}\nusage: tls_deploy.mjs --rendered FILE --make-secrets SCRIPT ` +
    '--coordinator BIN --worker BIN --ctl BIN --modules DIR [--out DIR] [--timeout 240]');
  process.exit(2);
}
if (!fs.existsSync(opts.rendered)) skip(`${opts.rendered} was not rendered (render_overlays.sh makes it)`);
if (spawnSync('openssl', ['version']).status !== 0) skip('openssl is not installed (make-secrets.sh needs it)');
const require = createRequire(path.join(path.resolve(opts.modules), 'package.json'));
const YAML = require('yaml');

const out = opts.out ? path.resolve(opts.out) : fs.mkdtempSync(path.join(os.tmpdir(), 'tls-deploy-'));
const marker = path.join(out, '.tls-deploy');  // an earlier run's folder, safe to empty
if (fs.existsSync(out) && fs.readdirSync(out).length > 0 && !fs.existsSync(marker)) {
  usage(`--out ${out} is neither empty nor an earlier run's folder`);
}
fs.rmSync(out, { recursive: true, force: true });
fs.mkdirSync(out, { recursive: true, mode: 0o755 });
fs.writeFileSync(marker, '');
fs.chmodSync(out, 0o755);  // the pods' users pass through it
const started = Date.now();
const deadline = started + opts.timeout * 1000;
const log = (m) => console.log(`[${((Date.now() - started) / 1000).toFixed(1)}s] ${m}`);
const processes = new Processes(out, log);
const until = (what, probe, o = {}) => untilOr(what, probe, { deadline, ...o });
const asRoot = process.getuid() === 0;
const binaries = {
  'muonmesh-coordinator': opts.coordinator, 'muonmesh-worker': opts.worker, muonmeshctl: opts.ctl,
};

// ------------------------------------------------------------ the secrets

// make-secrets.sh with a kubectl that keeps what it is asked to apply.
function makeSecrets() {
  const shim = path.join(out, 'bin');
  const applied = path.join(out, 'applied');
  fs.mkdirSync(shim);
  fs.mkdirSync(applied);
  const real = spawnSync('sh', ['-c', 'command -v kubectl'], { encoding: 'utf8' }).stdout.trim();
  if (!real) skip('kubectl is not installed');
  fs.writeFileSync(path.join(shim, 'kubectl'), [
    '#!/bin/sh',
    'for a in "$@"; do',
    `  if [ "$a" = apply ]; then cat >"${applied}/$(date +%s%N).yaml"; exit 0; fi`,
    'done',
    `exec "${real}" "$@"`, ''].join('\n'), { mode: 0o755 });
  const keep = path.join(out, 'kept');
  const r = spawnSync(opts['make-secrets'], [keep], {
    encoding: 'utf8', env: { ...process.env, PATH: `${shim}:${process.env.PATH}` },
  });
  if (r.status !== 0) throw new Error(`make-secrets.sh failed: ${r.stdout}${r.stderr}`);
  const secrets = new Map();
  for (const f of fs.readdirSync(applied).sort()) {
    const o = YAML.parse(fs.readFileSync(path.join(applied, f), 'utf8'));
    if (o?.kind === 'Secret') {
      secrets.set(o.metadata.name, Object.fromEntries(
        Object.entries(o.data ?? {}).map(([k, v]) => [k, Buffer.from(v, 'base64')])));
    }
  }
  log(`make-secrets.sh made ${[...secrets.keys()].join(', ')}`);
  return { secrets, keep };
}

// ---------------------------------------------------------------- the pods

// A pod of `workload` (its rendered object) named `name`: its folders, its
// ports, and its container's command line and environment, localized.
function localPod(workload, name, secrets, configMaps) {
  const spec = workload.spec.template.spec;
  const container = spec.containers[0];
  const security = spec.securityContext ?? {};
  const uid = security.runAsUser;
  const gid = security.runAsGroup ?? uid;
  const podDir = path.join(out, 'pods', name);
  const mounts = [];  // [mountPath, local folder], longest first
  for (const m of container.volumeMounts ?? []) {
    const v = spec.volumes.find((x) => x.name === m.name);
    let dir;
    if (v.persistentVolumeClaim) {
      dir = path.join(out, 'claims', v.persistentVolumeClaim.claimName);
      fs.mkdirSync(dir, { recursive: true });
      if (asRoot) fs.chownSync(dir, uid, gid);
    } else if (v.emptyDir) {
      dir = path.join(podDir, 'empty', v.name);
      fs.mkdirSync(dir, { recursive: true });
      if (asRoot) fs.chownSync(dir, uid, gid);
    } else {
      const files = v.secret ? secrets.get(v.secret.secretName) : configMaps.get(v.configMap.name);
      if (!files) throw new Error(`${name}: volume ${v.name} needs ${v.secret ? 'Secret' : 'ConfigMap'} ` +
        `${v.secret?.secretName ?? v.configMap?.name}, which was not made`);
      dir = path.join(podDir, 'files', v.name);
      fs.mkdirSync(dir, { recursive: true });
      let mode = (v.secret ?? v.configMap).defaultMode ?? 0o644;
      if (security.fsGroup !== undefined && (mode & 0o400)) mode |= 0o040;
      for (const [key, data] of Object.entries(files)) {
        const file = path.join(dir, key);
        fs.writeFileSync(file, data, { mode });
        fs.chmodSync(file, mode);
        if (asRoot) fs.chownSync(file, 0, security.fsGroup ?? 0);
      }
    }
    mounts.push([m.mountPath, dir]);
  }
  mounts.sort((a, b) => b[0].length - a[0].length);
  const local = (s) => {
    for (const [from, to] of mounts) {
      if (s === from || s.startsWith(`${from}/`)) return to + s.slice(from.length);
    }
    return s;
  };
  const env = {};
  for (const e of container.env ?? []) {
    const field = e.valueFrom?.fieldRef?.fieldPath;
    // Every pod on one node, which this machine stands in for.
    const fields = { 'metadata.name': name, 'status.podIP': '127.0.0.1', 'spec.nodeName': 'node-0' };
    env[e.name] = field !== undefined ? fields[field] : e.value;
  }
  const expand = (s) => s.replace(/\$\(([A-Za-z_][A-Za-z0-9_]*)\)/g, (all, v) => env[v] ?? all);
  return {
    name, uid: asRoot ? uid : undefined, container, local, env,
    labels: workload.spec.template.metadata?.labels ?? {},
    argv: [...(container.command ?? []), ...(container.args ?? [])].map(expand),
    cwd: container.workingDir ? local(container.workingDir) : undefined,
  };
}

// Listen addresses on a containerPort move to free loopback ports; a
// Service's name and port become the loopback port of the pod it selects,
// and its name the TLS server name the process verifies.
async function placePorts(pods, services) {
  const ports = new Map();  // `${pod}:${containerPort}` -> 127.0.0.1:local port
  for (const pod of pods) {
    for (const p of pod.container.ports ?? []) {
      ports.set(`${pod.name}:${p.containerPort}`, `127.0.0.1:${await freePort()}`);
    }
  }
  const dial = new Map();  // `${service}:${port}` -> [local address, service]
  for (const s of services) {
    const pod = pods.find((p) => Object.entries(s.spec.selector ?? {})
      .every(([k, v]) => p.labels[k] === v));
    if (!pod || s.spec.clusterIP === 'None') continue;
    for (const sp of s.spec.ports) {
      const target = (pod.container.ports ?? []).find((p) => p.name === sp.targetPort ||
        p.containerPort === (sp.targetPort ?? sp.port));
      if (target) {
        const at = ports.get(`${pod.name}:${target.containerPort}`);
        dial.set(`${s.metadata.name}:${sp.port}`, [at, s.metadata.name]);
      }
    }
  }
  for (const pod of pods) {
    pod.argv = pod.argv.map((a) => {
      const listen = /^(?:0\.0\.0\.0)?:(\d+)$/.exec(a);
      if (listen && ports.has(`${pod.name}:${listen[1]}`)) return ports.get(`${pod.name}:${listen[1]}`);
      if (dial.has(a)) {
        pod.env.MUONMESH_TLS_SERVER_NAME = dial.get(a)[1];
        return dial.get(a)[0];
      }
      return pod.local(a);
    });
    const binary = binaries[path.basename(pod.argv[0])];
    if (!binary) throw new Error(`${pod.name}: no local binary for ${pod.argv[0]}`);
    pod.argv[0] = binary;
  }
  return dial;
}

// ------------------------------------------------------------------ checks

function ctl(args, env = {}) {
  return spawnSync(opts.ctl, args, { encoding: 'utf8', timeout: 30000, env: { ...process.env, ...env } });
}

async function main() {
  const objects = loadYamlDocuments(require, opts.rendered);
  const find = (kind, name) => {
    const o = objects.find((x) => x?.kind === kind && x.metadata?.name === name);
    if (!o) throw new Error(`${opts.rendered} has no ${kind}/${name}`);
    return o;
  };
  const { secrets, keep } = makeSecrets();
  const configMaps = new Map(objects.filter((o) => o?.kind === 'ConfigMap')
    .map((o) => [o.metadata.name, o.data ?? {}]));
  const coordinator = find('Deployment', 'muonmesh-coordinator');
  const workers = find('StatefulSet', 'muonmesh-worker');
  const submit = find('Job', 'muonmesh-submit');

  // The workers' container paths in the ConfigMaps' files (the job's
  // output folder) stand for the same local folders.
  const workerPods = [];
  for (let i = 0; i < (workers.spec.replicas ?? 1); ++i) {
    workerPods.push(localPod(workers, `muonmesh-worker-${i}`, secrets, configMaps));
  }
  for (const [name, files] of configMaps) {
    configMaps.set(name, Object.fromEntries(Object.entries(files).map(([k, v]) =>
      [k, v.replace(/\/[\w./-]+/g, (p) => workerPods[0].local(p))])));
  }
  const coordinatorPod = localPod(coordinator, 'muonmesh-coordinator-0', secrets, configMaps);
  const submitPod = localPod(submit, 'muonmesh-submit-0', secrets, configMaps);
  // The job file the submit Job sends (its ConfigMap's one file), localized.
  const jobText = Object.values(configMaps.get(submit.spec.template.spec.volumes
    .find((v) => v.configMap).configMap.name))[0];
  const pods = [coordinatorPod, ...workerPods, submitPod];
  const services = objects.filter((o) => o?.kind === 'Service');
  const dial = await placePorts(pods, services);

  // 1. The certificate names the Service the pods dial.
  const [address, serverName] = dial.get('muonmesh-coordinator:50051') ?? [];
  if (!address) throw new Error('no Service muonmesh-coordinator:50051 selects the coordinator');
  const san = spawnSync('openssl', ['x509', '-noout', '-ext', 'subjectAltName', '-in',
    path.join(keep, 'coordinator.pem')], { encoding: 'utf8' }).stdout;
  if (!san.includes(`DNS:${serverName}`)) {
    fail(`the coordinator's certificate does not name ${serverName}: ${san.trim()}`);
  }
  const ca = path.join(keep, 'ca.pem');
  const as = (role) => ({ MUONMESH_TLS_CA: ca, MUONMESH_TOKEN_FILE: path.join(keep, `${role}.token`),
    MUONMESH_TLS_SERVER_NAME: serverName });

  // 2. The deployment runs the example job over TLS.
  const start = (pod) =>
    processes.start(pod.name, pod.argv, { uid: pod.uid, env: pod.env, cwd: pod.cwd });
  const coordinatorProcess = start(coordinatorPod);
  await until('the coordinator to answer a viewer over TLS', () => {
    if (coordinatorProcess.exitCode !== null) {
      throw new Error(`the coordinator exited: ${processes.logOf(coordinatorPod.name)}`);
    }
    return ctl(['workers', '--coordinator', address], as('viewer')).status === 0;
  }, { timeoutMs: 30000 });
  for (const pod of workerPods) start(pod);
  await until(`${workerPods.length} workers registered`, () => {
    const r = ctl(['workers', '--json', '--coordinator', address], as('viewer'));
    return r.status === 0 && (JSON.parse(r.stdout).workers ?? []).length === workerPods.length;
  }, { timeoutMs: 60000 });
  log(`${workerPods.length} workers registered over mutual TLS`);
  const submitted = start(submitPod);
  const { code } = await submitted.exited;
  const submitLog = processes.logOf(submitPod.name);
  if (code !== 0) throw new Error(`the submit Job's muonmeshctl exited ${code}: ${submitLog}`);
  const jobId = submitLog.trim().split('\n').pop().trim();
  log(`the submit Job submitted ${jobId}`);
  const job = await until(`job ${jobId} to end`, () => {
    const r = ctl(['status', jobId, '--json', '--coordinator', address], as('viewer'));
    const j = r.status === 0 ? JSON.parse(r.stdout) : null;
    const state = JSON.stringify(j?.state ?? j?.job?.state ?? '');
    return /SUCCEEDED|FAILED|CANCELLED/.test(state) ? { state, j } : null;
  }, { timeoutMs: Math.max(10000, deadline - Date.now() - 40000), everyMs: 1000 });
  if (!job.state.includes('SUCCEEDED')) fail(`job ${jobId} ended ${job.state}: ${JSON.stringify(job.j)}`);
  const exported = YAML.parse(jobText).output?.export ?? '';
  if (!fs.existsSync(exported)) fail(`job ${jobId}'s export ${exported} was not written`);
  log(`job ${jobId} ${job.state}; export ${exported}`);

  // 3. Refusals.
  // muonmeshctl's exit codes: 3 unreachable, 5 refused by the coordinator.
  const refused = (what, r, pattern, code) => {
    const said = `${r.stdout}${r.stderr}`.trim();
    if (r.status !== code || !pattern.test(said)) {
      fail(`${what} was not refused as expected (exit ${r.status}): ${said}`);
    } else {
      log(`refused ${what} (exit ${r.status}): ${said.split('\n')[0]}`);
    }
  };
  const noToken = { ...as('viewer'), MUONMESH_TOKEN_FILE: '', MUONMESH_TOKEN: '' };
  refused('a client without a token', ctl(['list', '--coordinator', address], noToken),
    /needs a bearer token/, 5);
  const plaintext = { MUONMESH_TLS_CA: '', MUONMESH_TOKEN_FILE: '', MUONMESH_TOKEN: '' };
  refused('a plaintext client', ctl(['list', '--coordinator', address], plaintext),
    /cannot reach the coordinator/, 3);
  const jobFile = path.join(out, 'viewer-job.yaml');
  fs.writeFileSync(jobFile, jobText);
  refused('a viewer submitting', ctl(['submit', jobFile, '--coordinator', address], as('viewer')),
    /role viewer may not call \/muonmesh.v1.Jobs\/SubmitJob/, 5);
  const outside = path.join(out, 'outside-job.yaml');
  const elsewhere = YAML.parse(jobText);
  elsewhere.output = { dir: '/srv/elsewhere/run', export: '/srv/elsewhere/run/final.safetensors' };
  fs.writeFileSync(outside, YAML.stringify(elsewhere));
  refused('a job file writing outside the runs volume',
    ctl(['submit', outside, '--coordinator', address], as('submitter')), /output\.dir/, 5);
  // A worker of the StatefulSet with the worker token but without its
  // client certificate (its own id and metrics port).
  const intruder = { ...workerPods[0], name: 'muonmesh-worker-intruder' };
  const dropped = ['--tls-cert', '--tls-key'];
  const metrics = `127.0.0.1:${await freePort()}`;
  intruder.argv = intruder.argv
    .filter((a, i, all) => !dropped.includes(a) && !dropped.includes(all[i - 1]))
    .map((a, i, all) => (all[i - 1] === '--worker-id' ? intruder.name
      : all[i - 1] === '--metrics-listen' ? metrics : a));
  const intruderProcess = start(intruder);
  await until('the worker without a client certificate to be refused', () =>
    /UNAUTHENTICATED|PERMISSION_DENIED/.test(processes.logOf(intruder.name)), { timeoutMs: 20000 })
    .catch((e) => fail(`${e.message}: ${processes.logOf(intruder.name)}`));
  if (intruderProcess.exitCode === null) intruderProcess.kill('SIGTERM');
  const listed = ctl(['workers', '--json', '--coordinator', address], as('viewer'));
  if (listed.stdout.includes(intruder.name)) {
    fail('a worker without the client certificate registered');
  } else {
    const said = processes.logOf(intruder.name).trim().split('\n').pop();
    log(`refused a worker without a client certificate: ${said}`);
  }
}

try {
  await main();
} catch (e) {
  fail(e.message);
}
await processes.stopAll();
if (failures.length === 0 && !opts.out) fs.rmSync(out, { recursive: true, force: true });
finish(`tls_deploy (logs in ${out})`);
