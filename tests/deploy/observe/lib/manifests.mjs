// The manifests check: every object `kubectl kustomize` rendered validates
// against the Kubernetes API schemas (kubernetes-models) or its CRD's schema
// (@kubernetes-models/prometheus-operator); pods follow the restricted
// security profile; references between objects resolve; the example job
// fits the fleet.

import fs from 'node:fs';
import path from 'node:path';

import {
  containersOf, describe, fail, finish, loadYamlDocuments, matches, modules, podSpecOf, renderedFiles,
  selects, named,
} from './common.mjs';

// The module of the model that knows apiVersion/kind's schema, or null.
function modelFor(require, apiVersion, kind) {
  const [group, version] = apiVersion.includes('/') ? apiVersion.split('/') : ['', apiVersion];
  const candidates = group === 'monitoring.coreos.com'
    ? [`@kubernetes-models/prometheus-operator/${group}/${version}/${kind}`]
    : [`kubernetes-models/${group ? `${group}/` : ''}${version}/${kind}`];
  for (const id of candidates) {
    try {
      const mod = require(id);
      if (mod[kind]) return mod[kind];
    } catch (e) {
      if (e.code !== 'MODULE_NOT_FOUND') throw e;
    }
  }
  return null;
}

// service's pods (explicit non-root user, read-only root, resources, tags).
function checkPodSecurity(where, spec) {
  const pod = spec.securityContext ?? {};
  for (const flag of ['hostNetwork', 'hostPID', 'hostIPC']) {
    if (spec[flag] === true) fail(`${where}: ${flag}: true shares the node's namespaces`);
  }
  for (const v of spec.volumes ?? []) {
    if (v.hostPath) fail(`${where}: volume "${v.name}" mounts the node's ${v.hostPath.path} (hostPath)`);
  }
  if (spec.automountServiceAccountToken !== false) {
    fail(`${where}: automountServiceAccountToken is not false (no muonmesh process uses the Kubernetes API)`);
  }
  if (pod.runAsUser === 0) fail(`${where}: runs as root (pod securityContext.runAsUser: 0)`);
  if (pod.runAsGroup === 0) fail(`${where}: runs with the root group (pod securityContext.runAsGroup: 0)`);
  for (const c of containersOf(spec)) {
    const at = `${where}: container "${c.name}"`;
    const sc = c.securityContext ?? {};
    const user = sc.runAsUser ?? pod.runAsUser;
    const nonRoot = sc.runAsNonRoot ?? pod.runAsNonRoot;
    if (user === 0) fail(`${at}: runs as root (runAsUser: 0)`);
    else if (user === undefined) fail(`${at}: may run as root: no runAsUser, so the image's USER decides`);
    if (nonRoot !== true) fail(`${at}: may run as root: runAsNonRoot is not true`);
    if ((sc.runAsGroup ?? pod.runAsGroup) === 0) fail(`${at}: runs with the root group (runAsGroup: 0)`);
    if (sc.privileged === true) fail(`${at}: privileged: true`);
    if (sc.allowPrivilegeEscalation !== false) fail(`${at}: allowPrivilegeEscalation is not false`);
    if (sc.readOnlyRootFilesystem !== true) fail(`${at}: readOnlyRootFilesystem is not true`);
    const drop = sc.capabilities?.drop ?? [];
    if (!drop.includes('ALL')) fail(`${at}: capabilities.drop does not contain ALL`);
    const add = (sc.capabilities?.add ?? []).filter((cap) => cap !== 'NET_BIND_SERVICE');
    if (add.length > 0) fail(`${at}: adds capabilities ${add.join(', ')}`);
    const seccomp = (sc.seccompProfile ?? pod.seccompProfile)?.type;
    if (seccomp !== 'RuntimeDefault' && seccomp !== 'Localhost') {
      fail(`${at}: seccompProfile is ${seccomp ?? 'unset'}, not RuntimeDefault or Localhost`);
    }
    const image = c.image ?? '';
    const tagged = image.includes('@') || /:[^/]+$/.test(image);
    if (!tagged || image.endsWith(':latest')) fail(`${at}: image "${image}" has no fixed tag or digest`);
    if (!c.resources?.requests?.cpu || !c.resources?.requests?.memory) {
      fail(`${at}: no cpu and memory requests (the scheduler needs them)`);
    }
    if (!c.resources?.limits?.memory) fail(`${at}: no memory limit`);
  }
}

// References inside one pod: mounts, probes' ports, $(VAR)s in args.
function checkPodWiring(where, spec, byKindName) {
  const volumes = new Set((spec.volumes ?? []).map((v) => v.name));
  for (const v of spec.volumes ?? []) {
    const ref = v.configMap ? ['ConfigMap', v.configMap.name]
      : v.persistentVolumeClaim ? ['PersistentVolumeClaim', v.persistentVolumeClaim.claimName]
        : v.secret ? ['Secret', v.secret.secretName] : null;
    if (ref && !byKindName.has(`${ref[0]}/${ref[1]}`)) {
      fail(`${where}: volume "${v.name}" refers to ${ref[0]} "${ref[1]}", which is not in the manifests`);
    }
  }
  if (spec.serviceAccountName && !byKindName.has(`ServiceAccount/${spec.serviceAccountName}`)) {
    fail(`${where}: serviceAccountName "${spec.serviceAccountName}" is not in the manifests`);
  }
  for (const c of containersOf(spec)) {
    const at = `${where}: container "${c.name}"`;
    for (const m of c.volumeMounts ?? []) {
      if (!volumes.has(m.name)) fail(`${at}: mounts volume "${m.name}", which the pod does not define`);
    }
    const ports = c.ports ?? [];
    const hasPort = (p) => ports.some((cp) => (typeof p === 'number' ? cp.containerPort === p : cp.name === p));
    for (const probeName of ['startupProbe', 'readinessProbe', 'livenessProbe']) {
      const probe = c[probeName];
      if (!probe) continue;
      const port = probe.grpc?.port ?? probe.httpGet?.port ?? probe.tcpSocket?.port;
      if (port !== undefined && !hasPort(port)) {
        fail(`${at}: ${probeName} probes port ${port}, which the container does not declare`);
      }
    }
    const env = new Set((c.env ?? []).map((e) => e.name));
    for (const arg of [...(c.command ?? []), ...(c.args ?? [])]) {
      for (const [, name] of String(arg).matchAll(/\$\(([A-Za-z_][A-Za-z0-9_]*)\)/g)) {
        if (!env.has(name)) {
          fail(`${at}: argument "${arg}" uses $(${name}), which its env does not define ` +
            '(Kubernetes would pass it on literally)');
        }
      }
    }
  }
}

// The device a worker container runs on: its --device argument, with $(VAR)s
// resolved from plain env values.
function deviceOf(c) {
  const args = [...(c.command ?? []), ...(c.args ?? [])];
  const i = args.indexOf('--device');
  if (i < 0 || i + 1 >= args.length) return null;
  const env = Object.fromEntries((c.env ?? []).filter((e) => 'value' in e).map((e) => [e.name, e.value]));
  return String(args[i + 1]).replace(/\$\(([A-Za-z_][A-Za-z0-9_]*)\)/g, (m, n) => env[n] ?? m);
}

function checkDevices(where, spec, expect) {
  let gpuContainers = 0;
  for (const c of containersOf(spec)) {
    const device = deviceOf(c);
    if (device === null) continue;
    const at = `${where}: container "${c.name}"`;
    const gpus = c.resources?.limits?.['nvidia.com/gpu'];
    const cuda = device.startsWith('cuda');
    if (cuda && String(gpus) !== '1') fail(`${at}: --device ${device} without nvidia.com/gpu: 1 in its limits`);
    if (!cuda && gpus !== undefined) fail(`${at}: requests nvidia.com/gpu but runs --device ${device}`);
    const program = path.basename(String((c.command ?? [])[0] ?? ''));
    if (cuda && program !== 'muonmesh-worker-cuda') {
      fail(`${at}: --device ${device} needs muonmesh-worker-cuda, not ${program || 'the image entrypoint'}`);
    }
    if (cuda) gpuContainers++;
    if (expect === 'gpu' && !cuda) fail(`${at}: a GPU overlay runs a worker with --device ${device}`);
    if (expect === 'cpu' && cuda) fail(`${at}: a CPU overlay runs a worker with --device ${device}`);
  }
  return gpuContainers;
}

// Objects that refer to pods or Services by selector.
function checkSelectors(name, objects, peers = objects) {
  const pods = objects.map((o) => ({ o, pod: podSpecOf(o) })).filter((x) => x.pod?.spec);
  const peerPods = peers.map((o) => ({ o, pod: podSpecOf(o) })).filter((x) => x.pod?.spec);
  const podsSelectedBy = (selector) => pods.filter(({ pod }) => selects(selector, pod.labels));
  const podPorts = (list) => list.flatMap(({ pod }) => containersOf(pod.spec).flatMap((c) => c.ports ?? []));
  for (const { o, pod } of pods) {
    const where = `${name}: ${describe(o)}`;
    const selector = o.kind === 'CronJob' ? null : o.spec?.selector;
    if (selector && o.kind !== 'Job' && !selects(selector, pod.labels)) {
      fail(`${where}: spec.selector does not select its own pod template's labels`);
    }
    if (o.kind === 'StatefulSet') {
      const svc = objects.find((s) => s.kind === 'Service' && s.metadata?.name === o.spec?.serviceName);
      if (!svc) fail(`${where}: serviceName "${o.spec?.serviceName}" is not a Service in the manifests`);
      else if (svc.spec?.clusterIP !== 'None') fail(`${where}: its Service "${svc.metadata.name}" is not headless`);
    }
  }
  for (const o of objects) {
    const where = `${name}: ${describe(o)}`;
    if (o.kind === 'Service') {
      const selected = pods.filter(({ pod }) => matches(o.spec?.selector, pod.labels));
      if (!o.spec?.selector || selected.length === 0) {
        fail(`${where}: its selector matches no pod template`);
        continue;
      }
      const ports = podPorts(selected);
      for (const p of o.spec.ports ?? []) {
        const target = p.targetPort ?? p.port;
        const ok = ports.some((cp) => (typeof target === 'number' ? cp.containerPort === target : cp.name === target));
        if (!ok) fail(`${where}: port "${p.name}" targets ${target}, which the selected pods do not declare`);
      }
    } else if (o.kind === 'PodDisruptionBudget') {
      if (podsSelectedBy(o.spec?.selector).length === 0) fail(`${where}: its selector matches no pod template`);
    } else if (o.kind === 'NetworkPolicy') {
      const selected = podsSelectedBy(o.spec?.podSelector);
      if (selected.length === 0) fail(`${where}: podSelector matches no pod template`);
      const ports = podPorts(selected);
      for (const rule of o.spec?.ingress ?? []) {
        for (const peer of rule.from ?? []) {
          if (peer.podSelector && !peer.namespaceSelector &&
              peerPods.filter(({ pod }) => selects(peer.podSelector, pod.labels)).length === 0) {
            fail(`${where}: ingress from ${JSON.stringify(peer.podSelector)} matches no pod template`);
          }
        }
        for (const p of rule.ports ?? []) {
          if (typeof p.port === 'string' && !ports.some((cp) => cp.name === p.port)) {
            fail(`${where}: ingress port "${p.port}" is not a port of the selected pods`);
          }
        }
      }
    } else if (o.kind === 'ServiceMonitor') {
      const services = objects.filter((s) => s.kind === 'Service' && selects(o.spec?.selector, s.metadata?.labels));
      if (services.length === 0) fail(`${where}: its selector matches no Service`);
      for (const ep of o.spec?.endpoints ?? []) {
        if (!services.some((s) => (s.spec?.ports ?? []).some((p) => p.name === ep.port))) {
          fail(`${where}: endpoint port "${ep.port}" is not a port of the selected Services`);
        }
        if (ep.honorLabels === true) {
          fail(`${where}: endpoint "${ep.port}" sets honorLabels: true, which lets a target set ` +
            'its own `job` and break the rules (the job id is in job_id)');
        }
      }
    }
  }
}

// The example job fits the fleet the overlay deploys: world_size workers of
// its device kind exist (gang scheduling would leave it PENDING otherwise).
function checkExampleJob(require, name, objects) {
  const YAML = require('yaml');
  const workers = objects.filter((o) => o.kind === 'StatefulSet' || o.kind === 'Deployment')
    .map((o) => ({ o, devices: containersOf(podSpecOf(o).spec).map(deviceOf).filter((d) => d !== null) }))
    .filter((w) => w.devices.length > 0);
  if (workers.length === 0) return;  // a submit overlay alone: no fleet to fit
  for (const cm of objects.filter((o) => o.kind === 'ConfigMap')) {
    for (const [key, text] of Object.entries(cm.data ?? {})) {
      let job;
      try {
        job = YAML.parse(text);
      } catch (e) {
        fail(`${name}: ${describe(cm)} ${key}: YAML: ${e.message}`);
        continue;
      }
      if (!job?.world_size) continue;
      const kind = job.device ?? 'cpu';
      const fleet = workers.filter((w) => w.devices.every((d) => d.split(':')[0] === kind))
        .reduce((n, w) => n + (w.o.spec?.replicas ?? 1), 0);
      if (fleet < job.world_size) {
        fail(`${name}: ${describe(cm)} ${key}: job "${job.name}" needs ${job.world_size} ${kind} ` +
          `workers, the manifests run ${fleet}`);
      }
    }
  }
}

// The Secrets a --secrets-script (deploy/k8s/make-secrets.sh) creates with
// its `apply NAME ...` lines: the manifests may mount them though they are
// not among the rendered objects (they hold keys and tokens).
function madeSecrets(opts) {
  const script = opts['--secrets-script'];
  if (!script) return [];
  const names = [...fs.readFileSync(script, 'utf8').matchAll(/^apply (\S+) /gm)].map((m) => m[1]);
  if (names.length === 0) fail(`${script}: no 'apply NAME' line creates a Secret`);
  return names;
}

export function checkManifests(opts) {
  const require = modules(opts);
  const rendered = renderedFiles(opts);
  if (rendered.length === 0) usage('give at least one --rendered NAME=FILE');
  const expect = Object.fromEntries(named(opts['--expect'], '--expect'));
  const clusterScoped = new Set(['Namespace', 'ClusterRole', 'ClusterRoleBinding', 'PersistentVolume',
    'StorageClass', 'CustomResourceDefinition', 'PriorityClass']);
  const secrets = madeSecrets(opts);  // read once, for every rendered file
  const coreOnly = new Set(opts['--core-only']);
  // A core-only overlay is one part of a deployment (the deployment, or a
  // submit applied to it): what it names may be in the other parts.
  const everything = rendered.flatMap(([, file]) => loadYamlDocuments(require, file));
  for (const [name, file] of rendered) {
    const objects = loadYamlDocuments(require, file);
    if (objects.length === 0) fail(`${name}: ${file} holds no objects`);
    const known = coreOnly.has(name) ? everything : objects;
    const byKindName = new Set(known.map((o) => `${o.kind}/${o.metadata?.name}`));
    for (const secret of secrets) byKindName.add(`Secret/${secret}`);
    let gpuContainers = 0;
    let validated = 0;
    for (const o of objects) {
      const where = `${name}: ${describe(o)}`;
      if (!o.apiVersion || !o.kind) {
        fail(`${where}: no apiVersion or kind`);
        continue;
      }
      const Model = modelFor(require, o.apiVersion, o.kind);
      if (!Model) {
        fail(`${where}: no schema known for ${o.apiVersion} ${o.kind}`);
      } else {
        try {
          new Model(o).validate();
          validated++;
        } catch (e) {
          fail(`${where}: does not match the ${o.apiVersion} ${o.kind} schema: ${e.message}`);
        }
      }
      if (!clusterScoped.has(o.kind) && o.metadata?.namespace !== 'muonmesh') {
        fail(`${where}: namespace is ${o.metadata?.namespace ?? 'unset'}, not muonmesh`);
      }
      if (o.kind === 'Namespace' && o.metadata?.labels?.['pod-security.kubernetes.io/enforce'] !== 'restricted') {
        fail(`${where}: does not enforce the restricted Pod Security Standard`);
      }
      const pod = podSpecOf(o);
      if (pod?.spec) {
        checkPodSecurity(where, pod.spec);
        checkPodWiring(where, pod.spec, byKindName);
        gpuContainers += checkDevices(where, pod.spec, expect[name]);
      }
    }
    checkSelectors(name, objects, known);
    checkExampleJob(require, name, objects);
    if (coreOnly.has(name)) {
      // An overlay meant to apply on any cluster: no custom resources (the
      // Prometheus Operator's CRDs may be missing) and no Namespace (a
      // `kubectl delete -k` would take the state and checkpoints with it).
      for (const o of objects) {
        if (o.apiVersion?.startsWith('monitoring.coreos.com/')) {
          fail(`${name}: ${describe(o)} needs the Prometheus Operator (keep it in components/prometheus-operator)`);
        }
        if (o.kind === 'Namespace') fail(`${name}: ${describe(o)} is deleted with the overlay (keep it in components/namespace)`);
      }
    } else {
      for (const kind of ['Deployment', 'StatefulSet', 'Service', 'PersistentVolumeClaim', 'ConfigMap', 'Job',
        'ServiceMonitor', 'PrometheusRule', 'PodDisruptionBudget', 'NetworkPolicy', 'PriorityClass', 'Namespace']) {
        if (!objects.some((o) => o.kind === kind)) fail(`${name}: no ${kind} rendered`);
      }
    }
    if (expect[name] === 'gpu' && gpuContainers === 0) fail(`${name}: no worker requests a GPU`);
    console.log(`${name}: ${objects.length} objects, ${validated} valid against their schemas`);
  }
  finish('manifests');
}
