#!/usr/bin/env node
// Static checks of muonmesh's deployment and observability artifacts, each
// against the real thing where one exists:
//
//   manifests  every object `kubectl kustomize` rendered validates against the
//              Kubernetes API schemas (kubernetes-models) or its CRD's schema
//              (@kubernetes-models/prometheus-operator); pods follow the
//              restricted security profile; references between objects
//              (selectors, named ports, volumes, ConfigMaps, $(VAR)s) resolve.
//   metrics    every metric name in the alert/recording rules, the
//              PrometheusRule and the Grafana dashboards is exported by the
//              coordinator or a worker (names and types parsed out of their
//              C++ sources) or recorded by our rules; every dashboard query
//              parses (Prometheus's own grammar, then `promtool check rules`);
//              the PrometheusRule carries the same groups as the rules file.
//   docker     the Dockerfiles' COPY sources exist and survive .dockerignore,
//              their scripts are executable, and their user, ports,
//              entrypoints and working directories agree with the manifests.
//   prometheusrule
//              writes deploy/k8s/components/prometheus-operator/prometheusrule.yaml from the rules file.
//
// Usage (tests/deploy/observe/CMakeLists.txt runs these):
//   observe.mjs manifests --modules DIR --rendered NAME=FILE... [--expect NAME=cpu|gpu]...
//                         [--secrets-script deploy/k8s/make-secrets.sh]
//   observe.mjs metrics --modules DIR --metrics-source FILE... --rules FILE...
//               --dashboard FILE... [--rendered NAME=FILE]... [--promtool PATH]
//   observe.mjs docker --modules DIR --root DIR --rendered NAME=FILE...
//   observe.mjs prometheusrule --modules DIR --rules FILE --out FILE
// DIR (--modules) holds node_modules from install_node_deps.sh. Exit status:
// 0 all checks pass, 1 a check failed (each failure on its own line, naming
// the file and object), 2 usage error, 77 a prerequisite made by an earlier
// step (node_modules, a rendered overlay) is missing.

import { parseArgs, usage } from './lib/common.mjs';
import { checkDocker } from './lib/docker.mjs';
import { checkManifests } from './lib/manifests.mjs';
import { checkMetrics, writePrometheusRule } from './lib/metrics.mjs';

const opts = parseArgs(process.argv.slice(2));
switch (opts.command) {
  case 'manifests': checkManifests(opts); break;
  case 'metrics': checkMetrics(opts); break;
  case 'docker': checkDocker(opts); break;
  case 'prometheusrule': writePrometheusRule(opts); break;
  default: usage(`unknown command '${opts.command ?? ''}'`);
}

