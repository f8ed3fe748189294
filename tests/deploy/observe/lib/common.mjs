// What every check shares: command-line options, failures collected and
// reported together, skips for missing prerequisites, YAML loading, and
// where pods live in Kubernetes objects.

import { createRequire } from 'node:module';
import fs from 'node:fs';
import path from 'node:path';

// ------------------------------------------------------------------ options

export function parseArgs(argv) {
  const multi = new Set(['--rendered', '--expect', '--metrics-source', '--rules', '--dashboard', '--core-only']);
  const single = new Set(['--modules', '--promtool', '--root', '--out', '--secrets-script']);
  const opts = { command: argv[0] };
  for (const m of multi) opts[m] = [];
  for (let i = 1; i < argv.length; i++) {
    const flag = argv[i];
    if (!multi.has(flag) && !single.has(flag)) usage(`unknown flag ${flag}`);
    if (i + 1 >= argv.length) usage(`${flag} needs a value`);
    const value = argv[++i];
    if (multi.has(flag)) opts[flag].push(value);
    else opts[flag] = value;
  }
  return opts;
}

export function usage(problem) {
  console.error(`observe.mjs: ${problem}\n` +
    'usage: observe.mjs manifests|metrics|docker|prometheusrule [flags] (see the header)');
  process.exit(2);
}

export function named(pairs, flag) {
  return pairs.map((p) => {
    const eq = p.indexOf('=');
    if (eq <= 0) usage(`${flag} wants NAME=VALUE, got '${p}'`);
    return [p.slice(0, eq), p.slice(eq + 1)];
  });
}

// A prerequisite that an earlier step (a ctest fixture) makes is missing:
// that step reported why, so this check skips (ctest's 77) instead of
// failing twice.
export function skip(message) {
  console.error(`SKIP: ${message}`);
  process.exit(77);
}

export function modules(opts) {
  if (!opts['--modules']) usage('--modules DIR is required');
  const dir = path.resolve(opts['--modules']);
  if (!fs.existsSync(path.join(dir, 'node_modules'))) {
    skip(`${dir}/node_modules is missing: tests/deploy/observe/install_node_deps.sh ${dir} installs it`);
  }
  return createRequire(path.join(dir, 'package.json'));
}

export function renderedFiles(opts) {
  const rendered = named(opts['--rendered'], '--rendered');
  for (const [, file] of rendered) {
    if (!fs.existsSync(file)) skip(`${file} was not rendered (tests/deploy/observe/render_overlays.sh makes it)`);
  }
  return rendered;
}

// Failures are collected and printed together, so one run names them all.
export const failures = [];
export function fail(message) {
  failures.push(message);
}

export function finish(what) {
  if (failures.length > 0) {
    for (const f of failures) console.error(`FAIL: ${f}`);
    console.error(`${what}: ${failures.length} problem(s)`);
    process.exit(1);
  }
  console.log(`${what}: OK`);
}

// --------------------------------------------------------------- YAML/JSON

export function loadYamlDocuments(require, file) {
  const YAML = require('yaml');
  const docs = YAML.parseAllDocuments(fs.readFileSync(file, 'utf8'));
  const objects = [];
  for (const doc of docs) {
    if (doc.errors.length > 0) {
      fail(`${file}: YAML: ${doc.errors[0].message}`);
      continue;
    }
    const value = doc.toJS();
    if (value !== null && value !== undefined) objects.push(value);
  }
  return objects;
}

export const describe = (o) => `${o?.kind ?? '?'}/${o?.metadata?.name ?? '?'}`;

// The pod template spec of a workload, or null for objects without pods.
export function podSpecOf(o) {
  switch (o.kind) {
    case 'Pod': return { spec: o.spec, labels: o.metadata?.labels ?? {} };
    case 'Deployment': case 'StatefulSet': case 'DaemonSet': case 'ReplicaSet': case 'Job':
      return { spec: o.spec?.template?.spec, labels: o.spec?.template?.metadata?.labels ?? {} };
    case 'CronJob':
      return {
        spec: o.spec?.jobTemplate?.spec?.template?.spec,
        labels: o.spec?.jobTemplate?.spec?.template?.metadata?.labels ?? {},
      };
    default: return null;
  }
}

export const containersOf = (spec) => [
  ...(spec?.initContainers ?? []), ...(spec?.containers ?? []), ...(spec?.ephemeralContainers ?? []),
];

export const matches = (selector, labels) =>
  Object.entries(selector ?? {}).every(([k, v]) => labels?.[k] === v);

// A label selector ({matchLabels, matchExpressions}) against labels.
export function selects(selector, labels) {
  if (!selector) return false;
  if (!matches(selector.matchLabels, labels)) return false;
  for (const e of selector.matchExpressions ?? []) {
    const has = Object.prototype.hasOwnProperty.call(labels ?? {}, e.key);
    const value = labels?.[e.key];
    if (e.operator === 'In' && !(has && e.values.includes(value))) return false;
    if (e.operator === 'NotIn' && has && e.values.includes(value)) return false;
    if (e.operator === 'Exists' && !has) return false;
    if (e.operator === 'DoesNotExist' && has) return false;
  }
  return true;
}

// The restricted Pod Security Standard, plus what an operator expects of a
