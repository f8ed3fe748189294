#!/usr/bin/env node
// End to end, on loopback, in bounded time: a real Prometheus (Debian's
// `prometheus`) scrapes a live coordinator and live workers, with
// deploy/prometheus's scrape jobs and rules, during a training job. Then:
//   1. `promtool check metrics` passes on a live scrape of the coordinator
//      and of a worker in the middle of the job;
//   2. every query of the Grafana dashboard (and its `job` variable)
//      returns data through Prometheus's HTTP API, with $job set to the job;
//   3. every rule parses and evaluates (the API answers each expression;
//      /api/v1/rules reports every rule healthy) and the recording rule has
//      data;
//   4. a job whose worker is stopped (SIGSTOP) fires MuonmeshJobStalled, a
//      job whose gradient turns infinite fires MuonmeshStepsRefused, and
//      killing a worker fires MuonmeshWorkerLost (every rule's `for:` cut
//      to 2 s; rules_test.yml holds the real ones);
//   5. the planned critical path the coordinator exports for the job
//      (muonmesh_job_planned_critical_path_flops) equals the executed one
//      (the busiest worker's Newton-Schulz FLOPs per step);
//   6. each panel's series are drawn into a PNG report (report_png.py,
//      matplotlib from Debian's python3-matplotlib), for a reviewer without
//      a Grafana.
// The coordinator runs as uid 10001 (the images' user) when this runs as
// root, with its state in a folder only that user owns.
//
//   e2e_observe.mjs --coordinator BIN --worker BIN --ctl BIN --modules DIR
//                   [--out DIR] [--workers 2] [--timeout 300] [--steps 60]
//                   [--embd 128] [--no-job] [--no-report]
// DIR (--modules) holds node_modules from install_node_deps.sh. --out keeps
// the logs, the Prometheus answers (results.json) and report.png (default: a
// temporary folder, removed on success). --no-job skips the training job
// and checks the rest (scrapes, rules, the lost worker). Exit 0: all passed;
// 1: a check failed (named on stderr); 2: usage; 77: prometheus or promtool
// is missing, or every check passed but the report could not be drawn
// because python3 or its matplotlib is missing (--no-report: not drawn).

import { createRequire } from 'node:module';
import { spawnSync } from 'node:child_process';
import fs from 'node:fs';
import os from 'node:os';
import path from 'node:path';

import { Processes, freePort, sleep, until as untilOr } from './lib/processes.mjs';

const here = path.dirname(new URL(import.meta.url).pathname);
const root = path.resolve(here, '../../..');
const rulesFile = path.join(root, 'deploy/prometheus/muonmesh.rules.yml');
const configFile = path.join(root, 'deploy/prometheus/prometheus.yml');
const dashboardFile = path.join(root, 'deploy/grafana/muonmesh-dashboard.json');

// ------------------------------------------------------------------ options

function parseArgs(argv) {
  const o = { workers: 2, timeout: 300, steps: 60, embd: 128, job: true, report: true };
  for (let i = 0; i < argv.length; i++) {
    const flag = argv[i];
    if (flag === '--no-job') { o.job = false; continue; }
    if (flag === '--no-report') { o.report = false; continue; }
    const value = argv[++i];
    if (value === undefined) usage(`${flag} needs a value`);
    const key = flag.replace(/^--/, '');
    if (!['coordinator', 'worker', 'ctl', 'modules', 'out', 'workers', 'timeout', 'steps', 'embd'].includes(key)) {
      usage(`unknown flag ${flag}`);
    }
    o[key] = ['workers', 'timeout', 'steps', 'embd'].includes(key) ? Number(value) : value;
  }
  for (const need of ['coordinator', 'worker', 'modules']) if (!o[need]) usage(`--${need} is required`);
  if (o.job && !o.ctl) usage('--ctl is required (or --no-job)');
  return o;
}

function usage(problem) {
  console.error(`e2e_observe.mjs: ${problem}\nsee the header of ${path.join(here, 'e2e_observe.mjs')}`);
  process.exit(2);
}

const opts = parseArgs(process.argv.slice(2));
const require = createRequire(path.join(path.resolve(opts.modules), 'package.json'));
const YAML = require('yaml');

for (const tool of ['prometheus', 'promtool']) {
  if (spawnSync('sh', ['-c', `command -v ${tool}`]).status !== 0) {
    console.error(`SKIP: ${tool} is not installed (Debian package prometheus)`);
    process.exit(77);
  }
}

// The report's Python: $MUONMESH_PYTHON, else Debian's, where
// python3-matplotlib installs. Without matplotlib the checks still run; a
// run that passes them then exits 77 (skipped), as the report is part of
// the test.
const python = process.env.MUONMESH_PYTHON ||
  (fs.existsSync('/usr/bin/python3') ? '/usr/bin/python3' : 'python3');
let reportMissing = null;
if (opts.report) {
  const probe = spawnSync(python, ['-c', 'import matplotlib'], { encoding: 'utf8' });
  if (probe.status !== 0) {
    reportMissing = `${python} cannot import matplotlib (Debian: apt-get install python3-matplotlib): ` +
      `${(probe.error?.message ?? probe.stderr ?? '').trim().split('\n').pop()}`;
    console.error(`WARNING: no PNG report: ${reportMissing}`);
  }
}

// --out is emptied first (a coordinator state left from an earlier run
// would hold its jobs), but only if it is empty or an earlier run's.
const out = opts.out ? path.resolve(opts.out) : fs.mkdtempSync(path.join(os.tmpdir(), 'e2e-observe-'));
const marker = path.join(out, '.e2e-observe');
if (fs.existsSync(out) && fs.readdirSync(out).length > 0) {
  if (!fs.existsSync(marker)) usage(`--out ${out} is neither empty nor an earlier run's folder`);
  fs.rmSync(out, { recursive: true, force: true });
}
fs.mkdirSync(out, { recursive: true });
fs.writeFileSync(marker, '');
const started = Date.now();
const deadline = started + opts.timeout * 1000;
const log = (m) => console.log(`[${((Date.now() - started) / 1000).toFixed(1)}s] ${m}`);

// ------------------------------------------------------------ processes

const processes = new Processes(out, log);
const children = processes.children;
const start = (name, argv, o) => processes.start(name, argv, o);
const stopAll = () => processes.stopAll();
const logOf = (name) => processes.logOf(name);
const until = (what, probe, o = {}) => untilOr(what, probe, { deadline, ...o });

// --------------------------------------------------------------- checks

const failures = [];
function fail(message) {
  failures.push(message);
  console.error(`FAIL: ${message}`);
}

async function httpText(url) {
  const r = await fetch(url, { signal: AbortSignal.timeout(5000) });
  if (!r.ok) throw new Error(`${url}: HTTP ${r.status}`);
  return r.text();
}

function promtoolCheckMetrics(name, text) {
  fs.writeFileSync(path.join(out, `${name}.metrics.txt`), text);
  const r = spawnSync('promtool', ['check', 'metrics'], { input: text, encoding: 'utf8' });
  if (r.status !== 0) fail(`promtool check metrics rejects the scrape of ${name}: ${(r.stdout + r.stderr).trim()}`);
  else log(`promtool check metrics: ${name} OK`);
}

// Where the coordinator serves gRPC and /metrics, and Prometheus its API.
const ports = { coordinator: null, coordinatorMetrics: null };
let prom;
async function api(pathAndQuery) {
  const r = await fetch(`http://127.0.0.1:${prom}${pathAndQuery}`, { signal: AbortSignal.timeout(10000) });
  const body = await r.json();
  if (body.status !== 'success') throw new Error(`${pathAndQuery}: ${body.errorType}: ${body.error}`);
  return body.data;
}

const query = (expr, time) => api(`/api/v1/query?query=${encodeURIComponent(expr)}${time ? `&time=${time}` : ''}`);
const queryRange = (expr, from, to, step) => api(`/api/v1/query_range?query=${encodeURIComponent(expr)}` +
  `&start=${from}&end=${to}&step=${step}`);

const hasFiniteValue = (series) => series.some((s) => (s.values ?? [s.value]).some(([, v]) => Number.isFinite(Number(v))));

// The coordinator's flags as the manifests and images pass them, checked
// against its --help first: a renamed flag fails here, by name, and not as
// a crash loop in a cluster.
function checkFlags(binary, flags) {
  const help = spawnSync(binary, ['--help'], { encoding: 'utf8' });
  const text = `${help.stdout}${help.stderr}`;
  for (const f of flags) {
    if (!text.includes(f)) fail(`${path.basename(binary)} --help does not list ${f}, which deploy/k8s and docker/ pass it`);
  }
}

// ------------------------------------------------------------------ main

async function main() {
  checkFlags(opts.coordinator, ['--listen', '--data-dir', '--metrics-listen', '--shutdown-grace']);
  checkFlags(opts.worker, ['--coordinator', '--device', '--worker-id', '--address', '--memory-budget', '--metrics-listen']);
  if (failures.length > 0) throw new Error('the binaries do not take the flags the deployment passes');

  // 1. The coordinator, as the images' user when we can.
  const stateDir = path.join(out, 'state');
  fs.mkdirSync(stateDir, { recursive: true });
  const asImageUser = process.getuid() === 0 && spawnSync('sh', ['-c', 'command -v setpriv']).status === 0;
  if (asImageUser) {
    fs.chownSync(stateDir, 10001, 10001);
    fs.chmodSync(stateDir, 0o750);
    fs.chmodSync(out, 0o755);
  }
  const coordinatorMetrics = await freePort();
  ports.coordinatorMetrics = coordinatorMetrics;
  start('coordinator', [opts.coordinator, '--listen', '127.0.0.1:0', '--data-dir', stateDir,
    '--metrics-listen', `127.0.0.1:${coordinatorMetrics}`, '--shutdown-grace', '2s'],
  asImageUser ? { uid: 10001 } : {});
  const address = await until('the coordinator to listen', () => {
    const m = /muonmesh-coordinator listening on (\S+)/.exec(logOf('coordinator'));
    if (!m && children[0].exitCode !== null) throw new Error(`the coordinator exited: ${logOf('coordinator')}`);
    return m?.[1];
  }, { timeoutMs: 20000 });
  ports.coordinator = address;
  log(`coordinator at ${address}${asImageUser ? ' (uid 10001)' : ''}`);

  // 2. Workers.
  const workerPorts = [];
  const workers = [];
  for (let i = 0; i < opts.workers; i++) {
    const port = await freePort();
    workerPorts.push(port);
    workers.push(start(`worker-${i}`, [opts.worker, '--coordinator', address, '--device', 'cpu',
      '--worker-id', `e2e-worker-${i}`, '--address', '127.0.0.1', '--memory-budget', '2GiB',
      '--metrics-listen', `127.0.0.1:${port}`]));
  }
  for (const port of [coordinatorMetrics, ...workerPorts]) {
    await until(`/metrics on port ${port}`, () => httpText(`http://127.0.0.1:${port}/metrics`), { timeoutMs: 20000 });
  }
  promtoolCheckMetrics('coordinator', await httpText(`http://127.0.0.1:${coordinatorMetrics}/metrics`));

  // 3. Prometheus with deploy/prometheus's scrape jobs (names, honor_labels)
  // pointed at these processes, and its rules; 1 s intervals to be quick.
  prom = await freePort();
  const config = YAML.parse(fs.readFileSync(configFile, 'utf8'));
  config.global = { ...config.global, scrape_interval: '1s', scrape_timeout: '1s', evaluation_interval: '1s' };
  // The rules as shipped, with every `for:` cut to 2 s: what is checked
  // here is that each expression fires on the live series (its `for:` is
  // the unit tests' business, tests/deploy/observe/rules_test.yml), and a
  // 10-minute `for:` would not fit the test's time.
  const rules = YAML.parse(fs.readFileSync(rulesFile, 'utf8'));
  for (const group of rules.groups) {
    for (const rule of group.rules) if (rule.for) rule.for = '2s';
  }
  const liveRules = path.join(out, 'rules.yml');
  fs.writeFileSync(liveRules, YAML.stringify(rules));
  config.rule_files = [liveRules];
  for (const job of config.scrape_configs) {
    delete job.file_sd_configs;
    const ports = job.job_name === 'muonmesh-coordinator' ? [coordinatorMetrics] : workerPorts;
    job.static_configs = [{ targets: ports.map((p) => `127.0.0.1:${p}`) }];
  }
  fs.writeFileSync(path.join(out, 'prometheus.yml'), YAML.stringify(config));
  start('prometheus', ['prometheus', `--config.file=${path.join(out, 'prometheus.yml')}`,
    `--storage.tsdb.path=${path.join(out, 'tsdb')}`, `--web.listen-address=127.0.0.1:${prom}`,
    '--storage.tsdb.retention.time=1d', '--log.level=warn']);
  await until('Prometheus to be ready', () => httpText(`http://127.0.0.1:${prom}/-/ready`), { timeoutMs: 30000 });
  await until('every target up', async () => {
    const up = await query('up');
    return up.result.length === opts.workers + 1 && up.result.every((s) => s.value[1] === '1');
  }, { timeoutMs: 30000 });
  log(`Prometheus at 127.0.0.1:${prom} scrapes ${opts.workers + 1} targets`);
  const t0 = Date.now() / 1000;

  // 4. A job, scraped while it runs.
  let jobId = null;
  if (opts.job) jobId = await runJob(workerPorts);

  // 5. Dashboard queries, rules, the recording rule.
  await sleep(3000);
  const t1 = Date.now() / 1000;
  const results = { jobId, from: t0, to: t1, panels: [], rules: [], alerts: [] };
  if (jobId) await checkDashboard(results, jobId, t0, t1);
  if (jobId) await checkCriticalPath(results, jobId, t0, t1);
  await checkRules(results, t0, t1, jobId !== null);

  // 6. A stalled job and a diverging one fire their alerts.
  await checkStalledAndRefused(workers, workerPorts);

  // 7. A worker dies: its lease expires and MuonmeshWorkerLost fires.
  const victim = workers[workers.length - 1];
  victim.kill('SIGKILL');
  log(`killed ${victim.name}; waiting for MuonmeshWorkerLost`);
  try {
    const alert = await until('MuonmeshWorkerLost to fire', async () => {
      const { alerts } = await api('/api/v1/alerts');
      return alerts.find((a) => a.labels.alertname === 'MuonmeshWorkerLost' && a.state === 'firing');
    }, { timeoutMs: 60000, everyMs: 1000 });
    log(`MuonmeshWorkerLost fires: ${alert.annotations.summary}`);
  } catch (e) {
    fail(`MuonmeshWorkerLost did not fire after a worker was killed: ${e.message}`);
  }
  results.alerts = (await api('/api/v1/alerts')).alerts;
  results.lost = await queryRange('sum by (state) (muonmesh_workers)', t0, Date.now() / 1000, 1);

  fs.writeFileSync(path.join(out, 'results.json'), JSON.stringify(results, null, 1));
  if (opts.report && !reportMissing) report();
}

function submit(name, job) {
  const file = path.join(out, `${name}.yaml`);
  fs.writeFileSync(file, YAML.stringify({ name, device: 'cpu', init: { seed: 5 },
    data: { teacher: { seed: 21, samples: 256 } }, model: { mlp: { dims: [6, 16, 3] } },
    output: { dir: path.join(out, 'runs', name) }, ...job }));
  const r = spawnSync(opts.ctl, ['submit', file, '--coordinator', ports.coordinator], { encoding: 'utf8', timeout: 30000 });
  if (r.status !== 0) throw new Error(`muonmeshctl submit ${name} failed (${r.status}): ${r.stdout}${r.stderr}`);
  return r.stdout.trim().split('\n').pop().trim();
}

async function untilFiring(alertname, jobId) {
  return until(`${alertname} to fire for ${jobId}`, async () => {
    const { alerts } = await api('/api/v1/alerts');
    return alerts.find((a) => a.labels.alertname === alertname && a.labels.job_id === jobId && a.state === 'firing');
  }, { timeoutMs: 45000, everyMs: 500 });
}

// A job on two workers whose one worker is stopped (SIGSTOP: it keeps its
// lease for the lease TTL, 10 s, but steps no more) fires
// MuonmeshJobStalled; a job whose AdamW steps of 1e30 make its gradient
// infinite at step 1 fires MuonmeshStepsRefused.
async function checkStalledAndRefused(workers, workerPorts) {
  const stalled = submit('e2e-stalled', { world_size: 2, training: { steps: 1000000, global_batch_size: 8 } });
  log(`submitted ${stalled} to stall`);
  try {
    // Stepping, as Prometheus has seen it, on workers it has seen busy.
    const busy = await until(`${stalled} to step`, async () => {
      const stepped = (await query(`muonmesh_job_step_seconds{job_id="${stalled}"}`)).result.length > 0;
      const running = (await query('muonmesh_worker_busy == 1')).result.map((r) => r.metric.instance);
      return stepped && running.length > 0 ? running : null;
    }, { timeoutMs: 30000, everyMs: 500 });
    const victim = workers.find((w, i) => busy.includes(`127.0.0.1:${workerPorts[i]}`));
    if (!victim) throw new Error(`no busy worker among ${busy}`);
    victim.kill('SIGSTOP');
    log(`stopped ${victim.name}; waiting for MuonmeshJobStalled`);
    try {
      const alert = await untilFiring('MuonmeshJobStalled', stalled);
      log(`MuonmeshJobStalled fires: ${alert.annotations.summary}`);
    } finally {
      victim.kill('SIGCONT');
    }
  } catch (e) {
    fail(`MuonmeshJobStalled did not fire for a job whose worker was stopped: ${e.message}`);
  }
  spawnSync(opts.ctl, ['cancel', stalled, '--coordinator', ports.coordinator], { encoding: 'utf8', timeout: 30000 });

  const diverges = submit('e2e-diverges', {
    world_size: 1,
    optimizer: { adamw: { lr: 1e30 }, rules: [{ pattern: '.*', optimizer: 'adamw' }] },
    training: { steps: 20, global_batch_size: 8 },
  });
  log(`submitted ${diverges}, which diverges`);
  try {
    const alert = await untilFiring('MuonmeshStepsRefused', diverges);
    log(`MuonmeshStepsRefused fires: ${alert.annotations.summary}`);
  } catch (e) {
    fail(`MuonmeshStepsRefused did not fire for a job refusing a step: ${e.message}`);
  }
}

// A byte-level transformer with a mixture of experts in its second layer
// (its experts split over the ranks) on this repository's own prose,
// validated every 10 steps, so that every panel (validation loss and
// expert load included) has data; a qk_clip far above its logits (never
// acting) puts tau on the logit panel, and a health step every 5 the
// orthogonality error on its own.
async function runJob(workerPorts) {
  const corpus = path.join(out, 'corpus.txt');
  fs.writeFileSync(corpus, ['README.md', 'docs/architecture.md', 'BENCHMARKS.md']
    .map((f) => fs.readFileSync(path.join(root, f), 'utf8')).join('\n'));
  const job = {
    name: 'e2e-observe',
    world_size: Math.min(opts.workers, 2),
    device: 'cpu',
    parallelism: {
      data_parallel_sharding_strategy: 'optim_grads_params',
      expert_model_parallel_size: Math.min(opts.workers, 2),
    },
    model: {
      transformer: {
        vocab_size: 256, seq_len: 64, n_layer: 2, d_model: opts.embd, n_head: 4, n_kv_head: 2,
        ffn_hidden: 2 * opts.embd,
        moe: { n_routed_experts: 4, top_k: 2, moe_ffn_hidden: opts.embd, n_shared_experts: 1, first_k_dense: 1 },
      },
    },
    init: { seed: 7 },
    data: { text: { train: corpus } },
    optimizer: {
      muon: { lr: 0.02, momentum: 0.95, qk_clip: 1000, health_every: 5 },
      adamw: { lr: 0.003, beta2: 0.95 },
    },
    training: { steps: opts.steps, global_batch_size: 8, eval_every: 10, eval_batches: 2 },
    output: { dir: path.join(out, 'runs/e2e-observe') },
  };
  const finished = 'sum(muonmesh_jobs{state=~"SUCCEEDED|FAILED|CANCELLED"})';
  const before = Number((await query(finished)).result[0]?.value[1] ?? 0);
  const jobFile = path.join(out, 'job.yaml');
  fs.writeFileSync(jobFile, YAML.stringify(job));
  const submit = spawnSync(opts.ctl, ['submit', jobFile, '--coordinator', ports.coordinator], { encoding: 'utf8', timeout: 30000 });
  fs.writeFileSync(path.join(out, 'submit.log'), `${submit.stdout}${submit.stderr}`);
  if (submit.status !== 0) throw new Error(`muonmeshctl submit failed (${submit.status}): ${submit.stdout}${submit.stderr}`);
  const jobId = submit.stdout.trim().split('\n').pop().trim();
  log(`submitted job ${jobId}`);

  // promtool on a worker's scrape that holds the job's series.
  let checked = false;
  await until(`job ${jobId} to finish`, async () => {
    if (!checked) {
      for (const [i, port] of workerPorts.entries()) {
        const text = await httpText(`http://127.0.0.1:${port}/metrics`).catch(() => '');
        if (text.includes(`muonmesh_worker_steps_total{job_id="${jobId}"`)) {
          promtoolCheckMetrics(`worker-${i}`, text);
          promtoolCheckMetrics('coordinator-during-job', await httpText(`http://127.0.0.1:${ports.coordinatorMetrics}/metrics`));
          checked = true;
          break;
        }
      }
    }
    const done = await query(finished);
    return Number(done.result[0]?.value[1] ?? 0) > before;
  }, { timeoutMs: Math.max(10000, deadline - Date.now() - 90000), everyMs: 500 });
  if (!checked) fail(`no worker scrape caught job ${jobId}'s series while it ran (make it longer: --steps)`);
  const state = await query(`muonmesh_jobs{state="SUCCEEDED"}`);
  if (Number(state.result[0]?.value[1] ?? 0) < 1) fail(`job ${jobId} did not succeed (see ${out}/*.log)`);
  log(`job ${jobId} finished`);
  return jobId;
}

const escapeRegex = (s) => s.replace(/[.*+?^${}()|[\]\\]/g, '\\$&');

async function checkDashboard(results, jobId, t0, t1) {
  const dash = JSON.parse(fs.readFileSync(dashboardFile, 'utf8'));
  const variable = dash.templating.list.find((v) => v.name === 'job');
  const metric = /label_values\(\s*([^,]+),\s*job_id\s*\)/.exec(variable.definition)[1];
  const values = await api(`/api/v1/label/job_id/values?match[]=${encodeURIComponent(metric)}&start=${t0}&end=${t1}`);
  if (!values.includes(jobId)) fail(`dashboard variable "job" (label_values(${metric}, job_id)) lacks ${jobId}: ${values}`);
  const substitute = (expr) => expr
    .replace(/\$__rate_interval|\$\{__rate_interval\}/g, '5s')
    .replace(/\$__interval|\$\{__interval\}/g, '1s')
    .replace(/\$\{job(?::\w+)?\}|\$job\b/g, escapeRegex(jobId));
  let row = '';
  for (const panel of dash.panels.flatMap((p) => [p, ...(p.panels ?? [])])) {
    if (panel.type === 'row') {
      row = panel.title;
      continue;
    }
    const defaults = panel.fieldConfig?.defaults ?? {};
    const entry = {
      row, title: panel.title, unit: defaults.unit, axisLabel: defaults.custom?.axisLabel,
      stacked: defaults.custom?.stacking?.mode === 'normal', overrides: panel.fieldConfig?.overrides ?? [], targets: [],
    };
    for (const t of panel.targets ?? []) {
      const expr = substitute(t.expr);
      try {
        const data = await queryRange(expr, t0, t1, 1);
        entry.targets.push({ refId: t.refId, legend: t.legendFormat, expr, result: data.result });
        if (!hasFiniteValue(data.result)) fail(`dashboard panel "${panel.title}" query ${t.refId} returns no data: ${expr}`);
      } catch (e) {
        fail(`dashboard panel "${panel.title}" query ${t.refId} fails: ${e.message}`);
      }
    }
    results.panels.push(entry);
  }
  log(`evaluated ${results.panels.length} dashboard panels`);
}

// The coordinator's plan and the workers' execution agree on the Muon
// critical path: at every instant both are known (every worker has finished
// a step), the planned FLOPs per step of the busiest rank equal the largest
// FLOPs per step a worker ran, read
// from each worker's two counters as they are (flops / steps; not rate(),
// whose extrapolation at a series' start differs between the two). A worker
// adds a step's FLOPs and the step itself one after the other, so a scrape
// may fall between them: then its FLOPs are an exact multiple of the planned
// figure, one step ahead of (or behind) its steps; only that is forgiven, and
// never at the last instant, when the counters have stopped.
async function checkCriticalPath(results, jobId, t0, t1) {
  const job = escapeRegex(jobId);
  const planned = await queryRange(`max(muonmesh_job_planned_critical_path_flops{job_id=~"${job}"})`, t0, t1, 1);
  const perWorker = async (metric) => {
    const data = await queryRange(`${metric}{job_id=~"${job}"}`, t0, t1, 1);
    // One series per worker and job: keyed by its labels but the name.
    const key = ({ __name__, ...labels }) => JSON.stringify(Object.entries(labels).sort());
    return new Map(data.result.map((s) => [key(s.metric),
      new Map(s.values.map(([t, v]) => [t, Number(v)]))]));
  };
  const flops = await perWorker('muonmesh_worker_newton_schulz_flops_total');
  const steps = await perWorker('muonmesh_worker_steps_total');
  const rows = [];  // [planned, executed, torn] per instant
  for (const [t, v] of planned.result[0]?.values ?? []) {
    const p = Number(v);
    let executed = -Infinity;
    let torn = false;
    let reported = 0;
    for (const [worker, f] of flops) {
      const fl = f.get(t), st = steps.get(worker)?.get(t);
      if (!(st > 0) || !Number.isFinite(fl)) continue;
      ++reported;
      executed = Math.max(executed, fl / st);
      const inSteps = fl / p;
      if (Math.abs(inSteps - Math.round(inSteps)) < 1e-9 * inSteps && Math.abs(Math.round(inSteps) - st) === 1) {
        torn = true;
      }
    }
    // Only once every worker of the job has finished a step: before, the
    // busiest one may not have, and the maximum is over the others.
    if (Number.isFinite(p) && reported === flops.size) rows.push([p, executed, torn]);
  }
  results.criticalPath = rows;
  if (rows.length === 0) {
    fail(`no instant has both the planned and the executed critical path of job ${jobId}`);
    return;
  }
  const same = ([p, e]) => p > 0 && Math.abs(p - e) <= 1e-6 * p;
  const off = rows.filter((r, i) => !same(r) && !(r[2] && i < rows.length - 1));
  const torn = rows.filter((r) => !same(r) && r[2]).length;
  if (off.length > 0) {
    fail(`planned critical path of job ${jobId} differs from the executed one at ${off.length} of ` +
      `${rows.length} instants (planned, executed): ${JSON.stringify(off.slice(0, 3).map((r) => r.slice(0, 2)))}`);
  } else {
    log(`critical path: planned ${rows[0][0]} FLOPs per step = executed, at ${rows.length} instants` +
      (torn > 0 ? ` (${torn} scraped between a step's two counters)` : ''));
  }
}

async function checkRules(results, t0, t1, hadJob) {
  const groups = YAML.parse(fs.readFileSync(rulesFile, 'utf8')).groups;
  for (const rule of groups.flatMap((g) => g.rules)) {
    const name = rule.alert ?? rule.record;
    try {
      const data = await queryRange(rule.expr, t0, t1, 1);
      results.rules.push({ name, expr: rule.expr, series: data.result.length });
      if (rule.record && hadJob && !hasFiniteValue(data.result)) fail(`recording rule ${name} has no data`);
    } catch (e) {
      fail(`rule ${name} does not evaluate: ${e.message}`);
    }
  }
  const { groups: loaded } = await api('/api/v1/rules');
  const count = loaded.flatMap((g) => g.rules).length;
  const expected = groups.flatMap((g) => g.rules).length;
  if (count !== expected) fail(`Prometheus loaded ${count} rules, the rules file has ${expected}`);
  for (const r of loaded.flatMap((g) => g.rules)) {
    if (r.health !== 'ok') fail(`Prometheus reports rule ${r.name} ${r.health}: ${r.lastError}`);
  }
  if (hadJob) {
    const recorded = await queryRange('job_id:muonmesh_worker_step_seconds:max_rank_mean5m', t0, t1, 1);
    if (!hasFiniteValue(recorded.result)) fail('job_id:muonmesh_worker_step_seconds:max_rank_mean5m was never recorded');
  }
  log(`evaluated ${results.rules.length} rules; Prometheus reports ${count} loaded`);
}

function report() {
  const png = path.join(out, 'report.png');
  const r = spawnSync(python, [path.join(here, 'report_png.py'), path.join(out, 'results.json'), png],
    { encoding: 'utf8', timeout: 120000 });
  if (r.status !== 0) fail(`report_png.py failed: ${r.stdout}${r.stderr} (needs Debian's python3-matplotlib)`);
  else log(`report: ${png}`);
}

const timer = setTimeout(async () => {
  fail(`the test ran past --timeout ${opts.timeout}s`);
  await stopAll();
  process.exit(1);
}, opts.timeout * 1000 + 15000);

try {
  await main();
} catch (e) {
  fail(e.message);
}
await stopAll();
clearTimeout(timer);
if (failures.length > 0) {
  console.error(`e2e_observe: ${failures.length} problem(s); logs and answers in ${out}`);
  process.exit(1);
}
if (reportMissing) {
  console.error(`SKIP: every check passed, but the PNG report was not drawn: ${reportMissing}`);
  process.exit(77);
}
console.log(`e2e_observe: OK (${((Date.now() - started) / 1000).toFixed(0)} s; ${out})`);
if (!opts.out) fs.rmSync(out, { recursive: true, force: true });
