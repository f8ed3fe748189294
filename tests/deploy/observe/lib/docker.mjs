// The docker check: the Dockerfiles' COPY sources exist and survive
// .dockerignore, their scripts are executable, the build stage runs the
// project's scripts and the runtime stage holds binaries only, and user,
// ports, entrypoints and working directories agree with the manifests.

import fs from 'node:fs';
import path from 'node:path';

import {
  containersOf, describe, fail, finish, loadYamlDocuments, modules, podSpecOf, renderedFiles,
} from './common.mjs';

// Dockerfile instructions, continuation lines joined, comments dropped.
function parseDockerfile(file) {
  const lines = fs.readFileSync(file, 'utf8').split('\n');
  const out = [];
  let current = '';
  let start = 0;
  lines.forEach((raw, i) => {
    const line = raw.trimEnd();
    if (!current && (/^\s*#/.test(line) || !line.trim())) return;
    if (/^\s*#/.test(line)) return;
    if (!current) start = i + 1;
    current += (current ? ' ' : '') + line.replace(/\\$/, '').trim();
    if (!line.endsWith('\\')) {
      const [, op, args] = /^(\S+)\s*(.*)$/.exec(current);
      out.push({ op: op.toUpperCase(), args, line: start });
      current = '';
    }
  });
  return out;
}

const jsonArray = (args) => {
  try {
    const v = JSON.parse(args);
    return Array.isArray(v) ? v : null;
  } catch {
    return null;
  }
};

// A .dockerignore pattern as a RegExp over paths relative to the context.
function ignoreRegExp(pattern) {
  let p = pattern.replace(/^\/+/, '').replace(/\/+$/, '');
  let re = '';
  for (let i = 0; i < p.length; i++) {
    if (p.startsWith('**/', i)) { re += '(?:.*/)?'; i += 2; } else if (p.startsWith('**', i)) { re += '.*'; i += 1; } else if (p[i] === '*') re += '[^/]*';
    else if (p[i] === '?') re += '[^/]';
    else re += p[i].replace(/[.+^${}()|[\]\\]/g, '\\$&');
  }
  return new RegExp(`^${re}(?:/.*)?$`);
}

function ignoredBy(patterns, relative) {
  let ignored = false;
  for (const p of patterns) {
    const negate = p.startsWith('!');
    if (ignoreRegExp(negate ? p.slice(1) : p).test(relative)) ignored = !negate;
  }
  return ignored;
}

export function checkDocker(opts) {
  const root = path.resolve(opts['--root'] ?? '.');
  const docker = path.join(root, 'docker');
  const master = path.join(docker, '.dockerignore');
  const readIgnore = (f) => fs.readFileSync(f, 'utf8').split('\n').map((l) => l.trim()).filter((l) => l && !l.startsWith('#'));
  const images = {
    coordinator: { binaries: ['muonmesh-coordinator', 'muonmeshctl'], ports: [50051, 9090] },
    worker: { binaries: ['muonmesh-worker'], ports: [9100] },
    'worker-cuda': { binaries: ['muonmesh-worker-cuda'], ports: [9100] },
  };
  const facts = {};
  for (const [image, want] of Object.entries(images)) {
    const file = path.join(docker, `Dockerfile.${image}`);
    const where = path.relative(root, file);
    if (!fs.existsSync(file)) {
      fail(`${where}: missing`);
      continue;
    }
    const ignoreFile = `${file}.dockerignore`;
    if (!fs.existsSync(ignoreFile)) fail(`${path.relative(root, ignoreFile)}: missing (BuildKit reads it beside the Dockerfile)`);
    else if (fs.readFileSync(ignoreFile, 'utf8') !== fs.readFileSync(master, 'utf8')) {
      fail(`${path.relative(root, ignoreFile)}: differs from docker/.dockerignore`);
    }
    const ignore = fs.existsSync(ignoreFile) ? readIgnore(ignoreFile) : [];
    const steps = parseDockerfile(file);
    const stages = steps.filter((s) => s.op === 'FROM');
    if (stages.length < 2) fail(`${where}: not multi-stage (build and runtime stages)`);
    const lastFrom = steps.lastIndexOf(stages[stages.length - 1]);
    const runtime = steps.slice(lastFrom);
    const build = steps.slice(0, lastFrom);
    const runs = build.filter((s) => s.op === 'RUN').map((s) => s.args).join('\n');
    for (const script of ['deploy/local/install-deps.sh', 'deploy/local/build.sh', 'docker/runtime-packages.sh']) {
      if (!runs.includes(script)) fail(`${where}: the build stage does not run ${script}`);
    }
    for (const b of want.binaries) {
      if (!runs.includes(b)) fail(`${where}: the build stage does not build ${b}`);
    }
    if (/install-deps|build\.sh|apt-get install/.test(runtime.filter((s) => s.op === 'RUN').map((s) => s.args).join('\n'))) {
      fail(`${where}: the runtime stage installs build tools (only install-runtime-packages.sh belongs there)`);
    }
    // Every COPY from the context names files that exist and are not ignored.
    for (const s of steps.filter((x) => x.op === 'COPY' && !/--from=/.test(x.args))) {
      const parts = jsonArray(s.args) ?? s.args.split(/\s+/).filter((a) => !a.startsWith('--'));
      for (const src of parts.slice(0, -1)) {
        if (src === '.') continue;
        if (!fs.existsSync(path.join(root, src))) fail(`${where}:${s.line}: COPY ${src}: no such file in the repository`);
        else if (ignoredBy(ignore, src)) fail(`${where}:${s.line}: COPY ${src}: excluded by the .dockerignore`);
      }
    }
    for (const script of [...new Set([...runs.matchAll(/((?:deploy|docker)\/[\w./-]+\.sh)/g)].map((m) => m[1]))]) {
      const p = path.join(root, script);
      if (!fs.existsSync(p)) fail(`${where}: runs ${script}, which does not exist`);
      else if ((fs.statSync(p).mode & 0o111) === 0) fail(`${where}: runs ${script}, which is not executable`);
      else if (ignoredBy(ignore, script)) fail(`${where}: runs ${script}, which the .dockerignore excludes`);
    }
    for (const needed of ['deploy/local/install-deps.sh', 'deploy/local/build.sh', 'CMakeLists.txt', 'server', 'worker', 'client', 'proto']) {
      if (ignoredBy(ignore, needed)) fail(`${where}: the .dockerignore excludes ${needed}, which the build needs`);
    }
    for (const junk of ['.git', 'build', 'build-deploy', 'deploy/local/examples/runs']) {
      if (!ignoredBy(ignore, junk)) fail(`${where}: the .dockerignore lets ${junk} into the build context`);
    }
    const user = runtime.filter((s) => s.op === 'USER').pop()?.args;
    if (!user) fail(`${where}: the runtime stage sets no USER (it would run as root)`);
    else if (!/^[1-9]\d*(:[1-9]\d*)?$/.test(user)) fail(`${where}: USER ${user} is not a numeric non-root uid[:gid] (runAsNonRoot cannot verify a name)`);
    const exposed = runtime.filter((s) => s.op === 'EXPOSE').flatMap((s) => s.args.split(/\s+/)).map((p) => Number.parseInt(p, 10));
    for (const p of want.ports) if (!exposed.includes(p)) fail(`${where}: does not EXPOSE ${p}`);
    const entrypoint = jsonArray(runtime.filter((s) => s.op === 'ENTRYPOINT').pop()?.args ?? '');
    if (!entrypoint) fail(`${where}: no exec-form ENTRYPOINT in the runtime stage`);
    else if (path.basename(entrypoint[0]) !== want.binaries[0]) fail(`${where}: ENTRYPOINT runs ${entrypoint[0]}, not ${want.binaries[0]}`);
    const copied = runtime.filter((s) => s.op === 'COPY' && /--from=/.test(s.args)).map((s) => s.args);
    if (!copied.some((a) => /\s\/usr\/local\/bin\/?$/.test(a))) fail(`${where}: the binaries are not copied to /usr/local/bin`);
    facts[image] = {
      uid: /^\d+(:\d+)?$/.test(user ?? "") ? Number.parseInt(user, 10) : user,
      ports: exposed,
      entrypoint: entrypoint?.[0],
      workdir: runtime.filter((s) => s.op === 'WORKDIR').pop()?.args,
    };
  }
  // The manifests run what the images hold, as the images' user, on their ports.
  const require = modules(opts);
  for (const [name, file] of renderedFiles(opts)) {
    const objects = loadYamlDocuments(require, file);
    for (const o of objects) {
      const pod = podSpecOf(o);
      if (!pod?.spec) continue;
      for (const c of containersOf(pod.spec)) {
        const image = String(c.image ?? '').replace(/[:@].*$/, '').split('/').pop();
        const f = facts[image];
        const at = `${name}: ${describe(o)} container "${c.name}"`;
        if (!f) {
          fail(`${at}: image ${c.image} is not one of docker/'s images`);
          continue;
        }
        const uid = c.securityContext?.runAsUser ?? pod.spec.securityContext?.runAsUser;
        if (uid !== f.uid) fail(`${at}: runAsUser ${uid} differs from the image's USER ${f.uid}`);
        const program = (c.command ?? [])[0];
        if (program && !program.startsWith('/usr/local/bin/')) fail(`${at}: runs ${program}, not a binary of /usr/local/bin`);
        if (program && !images[image].binaries.includes(path.basename(program))) {
          fail(`${at}: runs ${program}, which image ${image} does not hold`);
        }
        for (const p of c.ports ?? []) {
          if (!f.ports.includes(p.containerPort)) fail(`${at}: port ${p.containerPort} is not EXPOSEd by docker/Dockerfile.${image}`);
        }
        if (c.workingDir && f.workdir && c.workingDir !== f.workdir) {
          fail(`${at}: workingDir ${c.workingDir} differs from the image's WORKDIR ${f.workdir}`);
        }
      }
    }
  }
  finish('docker');
}
