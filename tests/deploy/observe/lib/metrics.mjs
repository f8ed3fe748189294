// The metrics check: every metric the rules, the PrometheusRule and the
// dashboards name is exported (names and types parsed out of the C++
// sources) or recorded; every query parses by Prometheus's own grammar and
// by promtool; the PrometheusRule carries the rules file's groups. Also
// writes that PrometheusRule.

import fs from 'node:fs';
import path from 'node:path';
import { spawnSync } from 'node:child_process';

import {
  describe, fail, finish, loadYamlDocuments, modules, renderedFiles, usage,
} from './common.mjs';

// Metric families the C++ sources register: prometheus-cpp builders
// (BuildCounter().Name("...")) and hand-made families
// (MetricFamily name{"...", "help", MetricType::Gauge, ...}).
function exportedMetrics(sources) {
  const metrics = new Map();
  for (const file of sources) {
    const text = fs.readFileSync(file, 'utf8');
    let found = 0;
    for (const m of text.matchAll(/Build(Counter|Gauge|Histogram|Summary|Info)\s*\(\s*\)\s*\.Name\(\s*"([^"]+)"/g)) {
      metrics.set(m[2], { type: m[1].toLowerCase(), file });
      found++;
    }
    for (const m of text.matchAll(/MetricFamily\s*(?:[A-Za-z_]\w*\s*)?[{(]\s*"([^"]+)"/g)) {
      const tail = text.slice(m.index, m.index + 600).match(/MetricType::(\w+)/);
      metrics.set(m[1], { type: (tail?.[1] ?? 'untyped').toLowerCase(), file });
      found++;
    }
    if (found === 0) {
      fail(`${file}: no metric definitions found (neither .Name("...") nor MetricFamily{"..."}); ` +
        'has the registration style changed?');
    }
  }
  return metrics;
}

// Series names a family exposes in the text format.
function seriesNames(name, type) {
  if (type === 'histogram') return [`${name}_bucket`, `${name}_sum`, `${name}_count`];
  if (type === 'summary') return [name, `${name}_sum`, `${name}_count`];
  return [name];
}

// Series Prometheus itself makes for every target.
const kSynthetic = new Set(['up', 'scrape_duration_seconds', 'scrape_samples_scraped']);

// Grafana's variables, replaced so that the query is plain PromQL.
function substituteGrafana(expr) {
  return expr
    .replace(/\$__(rate_interval|interval|range)\b|\$\{__(rate_interval|interval|range)\}/g, '5m')
    .replace(/\[\[(\w+)\]\]|\$\{(\w+)(?::\w+)?\}|\$(\w+)/g, '.*');
}

// The values the code gives each closed label (a label whose values are a
// fixed set), read from the sources that emit them: a rule or a panel that
// matches another value matches nothing, silently. `root` is the checkout.
function closedLabels(root) {
  const read = (rel) => fs.readFileSync(path.join(root, rel), 'utf8');
  const literals = (text) => [...text.matchAll(/"([a-z_]+)"/g)].map((m) => m[1]);
  const enumValues = (text, prefix) =>
    [...text.matchAll(new RegExp(`\\b${prefix}([A-Z_]+) = `, 'g'))].map((m) => m[1]).filter((v) => v !== 'UNSPECIFIED');
  const between = (text, from, to) => {
    const i = text.indexOf(from);
    if (i < 0) throw new Error(`"${from}" not found: has the code moved?`);
    return text.slice(i, text.indexOf(to, i));
  };
  const phases = literals(between(read('worker/step_log.cc'), 'NamedPhases(const PhaseTimes& t) {', '}\n'));
  const coordinator = read('server/control/coordinator_metrics.cc');
  const codes = [...between(coordinator, 'kNames[] = {', '};').matchAll(/"([A-Z_]+)"/g)].map((m) => m[1]);
  const devices = [...between(coordinator, 'const char* device : {', '}').matchAll(/"(\w+)"/g)].map((m) => m[1]);
  const outcomes = [...between(read('worker/daemon.cc'), 'metrics_->OnAttemptEnd(', ';').matchAll(/"(\w+)"/g)].map((m) => m[1]);
  const certificates = ['server/auth/server_security.cc', 'worker/daemon.cc'].flatMap((file) =>
    [...read(file).matchAll(/certificate_files_?\["(\w+)"\]/g)].map((m) => m[1]));
  const states = [...enumValues(read('proto/muonmesh/v1/jobs.proto'), 'JOB_STATE_'),
    ...enumValues(read('proto/muonmesh/v1/fleet.proto'), 'WORKER_STATE_')];
  const labels = {
    phase: ['step', ...phases], code: codes, device: devices, outcome: outcomes, certificate: certificates, state: states,
  };
  for (const [label, values] of Object.entries(labels)) {
    if (values.length === 0) throw new Error(`no values found for label "${label}": has the code moved?`);
  }
  return Object.fromEntries(Object.entries(labels).map(([k, v]) => [k, new Set(v)]));
}

// The metric names an expression selects, its label matchers ({label, op,
// value}) and its syntax errors, by Prometheus's own grammar (lezer-promql,
// the one its UI uses).
function metricNamesIn(parser, expr) {
  const tree = parser.parse(expr);
  const names = [];
  const matchers = [];
  const errors = [];
  tree.iterate({
    enter(node) {
      if (node.type.isError) {
        errors.push(`syntax error at offset ${node.from}: "${expr.slice(Math.max(0, node.from - 10), node.from + 10)}"`);
      } else if (node.name === 'VectorSelector') {
        const id = node.node.getChild('Identifier');
        if (id) names.push(expr.slice(id.from, id.to));
      } else if (node.name === 'UnquotedLabelMatcher' || node.name === 'QuotedLabelMatcher') {
        const label = node.node.getChild('LabelName') ?? node.node.getChild('QuotedLabelName');
        const value = node.node.getChild('StringLiteral');
        const op = node.node.getChild('MatchOp');
        if (label && value && expr.slice(label.from, label.to).replace(/"/g, '') === '__name__') {
          names.push(JSON.parse(expr.slice(value.from, value.to)));
        } else if (label && value && op) {
          matchers.push({ label: expr.slice(label.from, label.to).replace(/"/g, ''),
            op: expr.slice(op.from, op.to), value: JSON.parse(expr.slice(value.from, value.to)) });
        }
      }
    },
  });
  return { names, matchers, errors };
}

// A matcher's literal values: "a" for =, the alternatives of "a|b|c" for
// =~ when they are plain words (a pattern with other syntax, or a Grafana
// variable made into ".*", is not checked).
function literalValues({ op, value }) {
  if (op === '=' || op === '!=') return [value];
  if ((op === '=~' || op === '!~') && /^[\w|]+$/.test(value)) return value.split('|');
  return [];
}

function rulesOf(require, file) {
  const YAML = require('yaml');
  let doc;
  try {
    doc = YAML.parse(fs.readFileSync(file, 'utf8'));
  } catch (e) {
    fail(`${file}: YAML: ${e.message}`);
    return [];
  }
  const groups = doc?.groups ?? doc?.spec?.groups;
  if (!Array.isArray(groups)) {
    fail(`${file}: no groups`);
    return [];
  }
  return groups.flatMap((g) => (g.rules ?? []).map((r) => ({ group: g.name, ...r })));
}

function dashboardQueries(file) {
  let dash;
  try {
    dash = JSON.parse(fs.readFileSync(file, 'utf8'));
  } catch (e) {
    fail(`${file}: not JSON: ${e.message}`);
    return [];
  }
  const queries = [];
  const panels = (dash.panels ?? []).flatMap((p) => [p, ...(p.panels ?? [])]);
  const ids = new Set();
  const variables = new Set((dash.templating?.list ?? []).map((v) => v.name));
  if (!variables.has('job')) fail(`${file}: the dashboard has no "job" template variable`);
  for (const p of panels) {
    if (ids.has(p.id)) fail(`${file}: panel id ${p.id} ("${p.title}") is used twice`);
    ids.add(p.id);
    if (p.type === 'row') continue;
    if (!p.gridPos) fail(`${file}: panel "${p.title}" has no gridPos`);
    if (!(p.targets ?? []).length) fail(`${file}: panel "${p.title}" has no queries`);
    for (const t of p.targets ?? []) {
      if (typeof t.expr !== 'string' || !t.expr.trim()) {
        fail(`${file}: panel "${p.title}" query ${t.refId}: no expr`);
        continue;
      }
      for (const [, , name] of t.expr.matchAll(/\$(\{)?(\w+)/g)) {
        if (!name.startsWith('__') && !variables.has(name)) {
          fail(`${file}: panel "${p.title}" query ${t.refId} uses $${name}, which is not a template variable`);
        }
      }
      queries.push({ where: `${file}: panel "${p.title}" query ${t.refId}`, expr: t.expr });
    }
  }
  for (const v of dash.templating?.list ?? []) {
    const q = typeof v.query === 'string' ? v.query : v.query?.query;
    const m = v.type === 'query' ? /label_values\(\s*([^,)]+)\s*,/.exec(q ?? '') : null;
    if (m) queries.push({ where: `${file}: variable "${v.name}"`, expr: m[1] });
  }
  return queries;
}

// promtool's own PromQL parser on one expression (as a recording rule).
function promtoolParses(promtool, expr) {
  const dir = fs.mkdtempSync(path.join(process.env.TMPDIR ?? '/tmp', 'observe-'));
  try {
    const file = path.join(dir, 'query.rules.yml');
    fs.writeFileSync(file, JSON.stringify({ groups: [{ name: 'q', rules: [{ record: 'q:q', expr }] }] }));
    const r = spawnSync(promtool, ['check', 'rules', file], { encoding: 'utf8' });
    if (r.error) throw r.error;
    return r.status === 0 ? null : (r.stdout + r.stderr).replace(/\s+/g, ' ').trim();
  } finally {
    fs.rmSync(dir, { recursive: true, force: true });
  }
}

// JSON with sorted keys: kustomize reorders the keys of what it renders.
function canonical(value) {
  return JSON.stringify(value, (key, v) => (v && typeof v === 'object' && !Array.isArray(v)
    ? Object.fromEntries(Object.keys(v).sort().map((k) => [k, v[k]]))
    : v));
}

export function checkMetrics(opts) {
  const require = modules(opts);
  const { parser } = require('@prometheus-io/lezer-promql');
  const exported = exportedMetrics(opts['--metrics-source']);
  if (opts['--metrics-source'].length === 0) usage('give --metrics-source FILE for each metrics .cc');
  const known = new Map();
  for (const [name, { type, file }] of exported) {
    for (const s of seriesNames(name, type)) known.set(s, `${type} ${name} (${path.basename(file)})`);
  }
  const recorded = new Set();
  const expressions = [];
  const ruleFiles = opts['--rules'];
  for (const file of ruleFiles) {
    for (const r of rulesOf(require, file)) {
      if (r.record) recorded.add(r.record);
      expressions.push({ where: `${file}: group "${r.group}" ${r.alert ? `alert ${r.alert}` : `record ${r.record}`}`, expr: String(r.expr ?? '') });
    }
  }
  // The PrometheusRule of each rendered overlay must carry the rules file's groups.
  const YAML = require('yaml');
  const reference = ruleFiles.length > 0 ? YAML.parse(fs.readFileSync(ruleFiles[0], 'utf8'))?.groups : null;
  for (const [name, file] of renderedFiles(opts)) {
    const rules = loadYamlDocuments(require, file).filter((o) => o.kind === 'PrometheusRule');
    if (rules.length === 0) fail(`${name}: no PrometheusRule rendered`);
    for (const o of rules) {
      if (reference && canonical(o.spec?.groups) !== canonical(reference)) {
        fail(`${name}: ${describe(o)}: its groups differ from ${ruleFiles[0]} ` +
          '(regenerate it: observe.mjs prometheusrule, see deploy/k8s/README.md)');
      }
      for (const g of o.spec?.groups ?? []) {
        for (const r of g.rules ?? []) {
          if (r.record) recorded.add(r.record);
          expressions.push({ where: `${name}: ${describe(o)} group "${g.name}" ${r.alert ?? r.record}`, expr: String(r.expr ?? '') });
        }
      }
    }
  }
  // The dashboard ConfigMap of each rendered deployment (Grafana's sidecar
  // loads it) must be the dashboard file itself.
  const dashboardFile = opts['--dashboard'][0];
  for (const [name, file] of dashboardFile ? renderedFiles(opts) : []) {
    const maps = loadYamlDocuments(require, file)
      .filter((o) => o.kind === 'ConfigMap' && o.metadata?.labels?.grafana_dashboard === '1');
    if (maps.length === 0) fail(`${name}: no ConfigMap labelled grafana_dashboard: "1" rendered`);
    const want = canonical(JSON.parse(fs.readFileSync(dashboardFile, 'utf8')));
    for (const o of maps) {
      for (const [key, text] of Object.entries(o.data ?? {})) {
        if (canonical(JSON.parse(text)) !== want) {
          fail(`${name}: ${describe(o)} ${key} differs from ${dashboardFile} ` +
            '(copy it to deploy/k8s/components/prometheus-operator/)');
        }
      }
    }
  }
  const dashboards = opts['--dashboard'].flatMap((f) => dashboardQueries(f).map((q) => ({ ...q, dashboard: true })));
  let closed = null;
  if (opts['--root']) {
    try {
      closed = closedLabels(opts['--root']);
    } catch (e) {
      fail(`label values: ${e.message}`);
    }
  }
  let names = 0;
  for (const q of [...expressions, ...dashboards]) {
    const expr = q.dashboard ? substituteGrafana(q.expr) : q.expr;
    const { names: used, matchers, errors } = metricNamesIn(parser, expr);
    for (const e of errors.slice(0, 1)) fail(`${q.where}: does not parse: ${e}`);
    for (const m of matchers) {
      const allowed = closed?.[m.label];
      if (!allowed) continue;
      for (const v of literalValues(m)) {
        if (!allowed.has(v)) {
          fail(`${q.where}: ${m.label}${m.op}"${m.value}": "${v}" is not a value the code gives ` +
            `"${m.label}" (${[...allowed].join(', ')})`);
        }
      }
    }
    for (const n of used) {
      names++;
      if (known.has(n) || recorded.has(n) || kSynthetic.has(n)) continue;
      const family = [...exported.keys()].find((f) => n.startsWith(f) || f.startsWith(n));
      const hint = family ? ` (exported: ${seriesNames(family, exported.get(family).type).join(', ')})` : '';
      fail(`${q.where}: metric "${n}" is not exported by the coordinator or the workers${hint}`);
    }
    if (q.dashboard && errors.length === 0 && opts['--promtool']) {
      const problem = promtoolParses(opts['--promtool'], expr);
      if (problem) fail(`${q.where}: promtool rejects it: ${problem}`);
    }
  }
  console.log(`metrics: ${exported.size} exported families, ${recorded.size} recorded, ` +
    `${expressions.length} rule expressions and ${dashboards.length} dashboard queries naming ${names} metrics`);
  finish('metrics');
}

export function writePrometheusRule(opts) {
  const require = modules(opts);
  const YAML = require('yaml');
  const file = opts['--rules'][0];
  if (!file || !opts['--out']) usage('prometheusrule needs --rules FILE --out FILE');
  const groups = YAML.parse(fs.readFileSync(file, 'utf8')).groups;
  const object = {
    apiVersion: 'monitoring.coreos.com/v1',
    kind: 'PrometheusRule',
    metadata: {
      name: 'muonmesh',
      labels: { 'app.kubernetes.io/name': 'muonmesh', 'app.kubernetes.io/component': 'monitoring' },
    },
    spec: { groups },
  };
  const header = '# GENERATED from deploy/prometheus/muonmesh.rules.yml by\n' +
    '#   tests/deploy/observe/observe.mjs prometheusrule --modules DIR \\\n' +
    '#     --rules deploy/prometheus/muonmesh.rules.yml --out deploy/k8s/components/prometheus-operator/prometheusrule.yaml\n' +
    '# Do not edit: edit the rules file and regenerate (a test compares the two).\n';
  fs.writeFileSync(opts['--out'], header + YAML.stringify(object, { lineWidth: 0 }));
  console.log(`wrote ${opts['--out']}`);
}
