// Child processes of an end-to-end check on loopback: each writes its
// output to OUT/NAME.log, runs as another uid when asked (setpriv, where
// the check runs as root), and all of them stop together; and the small
// waits such a check needs.

import { spawn } from 'node:child_process';
import fs from 'node:fs';
import net from 'node:net';
import path from 'node:path';

export class Processes {
  // `log`: one line of progress; `out`: where the NAME.log files go.
  constructor(out, log) {
    this.out = out;
    this.log = log;
    this.children = [];
  }

  // Starts `argv` as NAME; `uid` (optional) runs it as that user and
  // group; `env` (optional) adds to the environment; `cwd` its folder.
  start(name, argv, { uid, env, cwd } = {}) {
    const file = fs.openSync(path.join(this.out, `${name}.log`), 'w');
    const command = uid !== undefined
      ? ['setpriv', `--reuid=${uid}`, `--regid=${uid}`, '--clear-groups', ...argv] : argv;
    const child = spawn(command[0], command.slice(1), {
      stdio: ['ignore', file, file], env: { ...process.env, ...env }, cwd,
    });
    fs.closeSync(file);
    child.name = name;
    child.exited = new Promise((resolve) => child.on('exit', (code, signal) => resolve({ code, signal })));
    this.children.push(child);
    this.log(`started ${name} (pid ${child.pid}): ${argv.join(' ')}`);
    return child;
  }

  // SIGTERM to every child still running, SIGKILL to those left after 8 s.
  async stopAll() {
    const running = (c) => c.exitCode === null && c.signalCode === null;
    for (const c of this.children) if (running(c)) c.kill('SIGTERM');
    const grace = new Promise((r) => setTimeout(r, 8000));
    await Promise.race([Promise.all(this.children.map((c) => c.exited)), grace]);
    for (const c of this.children) if (running(c)) c.kill('SIGKILL');
  }

  logOf(name) {
    try {
      return fs.readFileSync(path.join(this.out, `${name}.log`), 'utf8');
    } catch {
      return '';
    }
  }
}

export const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

// Polls `probe` until it returns something truthy (returned), for at most
// timeoutMs and never past `deadline` (ms since the epoch).
export async function until(what, probe, { timeoutMs = 60000, everyMs = 500, deadline = Infinity } = {}) {
  const end = Math.min(Date.now() + timeoutMs, deadline);
  let last;
  while (Date.now() < end) {
    try {
      const value = await probe();
      if (value) return value;
    } catch (e) {
      last = e;
    }
    await sleep(everyMs);
  }
  throw new Error(`timed out waiting for ${what}${last ? ` (last error: ${last.message})` : ''}`);
}

// Ports this process has handed out: the kernel may offer a port again
// once its probe socket is closed, and two listeners given one port make the
// second fail to bind (seen: a coordinator's gRPC and metrics ports).
const handedOut = new Set();

function probePort() {
  return new Promise((resolve, reject) => {
    const server = net.createServer();
    server.on('error', reject);
    server.listen(0, '127.0.0.1', () => {
      const { port } = server.address();
      server.close(() => resolve(port));
    });
  });
}

// A TCP port free on 127.0.0.1 now, never one handed out before.
export async function freePort() {
  for (;;) {
    const port = await probePort();
    if (!handedOut.has(port)) {
      handedOut.add(port);
      return port;
    }
  }
}
