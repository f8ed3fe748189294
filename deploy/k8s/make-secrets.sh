#!/usr/bin/env bash
# Creates (or replaces) the Secrets that components/tls mounts, in namespace
# ${MUONMESH_NAMESPACE:-muonmesh}: a CA, the coordinator's certificate for
# its Service names, one client certificate for the workers, and a random
# token per role (the coordinator gets only their SHA-256).
#
#   deploy/k8s/make-secrets.sh DIR
#
# DIR (created, mode 700) keeps what you hand out and what you must guard:
# ca.pem (clients trust it), viewer.token / submitter.token / admin.token
# (give each to its users), and ca.key (keep it offline: it signs new
# worker certificates). Nothing secret is printed. Needs openssl and a
# kubectl that reaches the cluster.
set -euo pipefail
dir=${1:?usage: $0 DIR (where the CA key and the tokens are kept)}
ns=${MUONMESH_NAMESPACE:-muonmesh}
umask 077
mkdir -p "$dir"
cd "$dir"

key() { openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256 -out "$1" 2>/dev/null; }
sign() {  # NAME CN EXTENSIONS
  key "$1.key"
  openssl req -new -key "$1.key" -out "$1.csr" -subj "/CN=$2" 2>/dev/null
  printf '%s\n' "$3" >"$1.ext"
  openssl x509 -req -in "$1.csr" -CA ca.pem -CAkey ca.key -CAcreateserial -CAserial ca.srl \
    -out "$1.pem" -days 365 -extfile "$1.ext" 2>/dev/null
  rm -f "$1.csr" "$1.ext"
}

if [[ ! -f ca.key ]]; then
  key ca.key
  openssl req -x509 -new -key ca.key -out ca.pem -days 1825 -subj "/CN=muonmesh CA ($ns)" \
    -addext "basicConstraints=critical,CA:TRUE" \
    -addext "keyUsage=critical,keyCertSign,cRLSign" 2>/dev/null
fi
svc=muonmesh-coordinator
sign coordinator "$svc" "subjectAltName=DNS:$svc,DNS:$svc.$ns,DNS:$svc.$ns.svc,DNS:$svc.$ns.svc.cluster.local,DNS:localhost,IP:127.0.0.1
extendedKeyUsage=serverAuth"
sign worker muonmesh-worker "extendedKeyUsage=clientAuth"

: >tokens
for role in viewer submitter worker admin; do
  [[ -f $role.token ]] || openssl rand -hex 32 >"$role.token"
  printf '%s sha256:%s\n' "$role" "$(tr -d '\n' <"$role.token" | sha256sum | cut -d' ' -f1)" >>tokens
done

apply() { kubectl -n "$ns" create secret generic "$@" --dry-run=client -o yaml | kubectl apply -f -; }
kubectl create namespace "$ns" --dry-run=client -o yaml | kubectl apply -f -
apply muonmesh-coordinator-tls --from-file=tls.crt=coordinator.pem \
  --from-file=tls.key=coordinator.key --from-file=ca.crt=ca.pem
apply muonmesh-tokens --from-file=tokens=tokens
apply muonmesh-worker-tls --from-file=tls.crt=worker.pem --from-file=tls.key=worker.key \
  --from-file=ca.crt=ca.pem --from-file=token=worker.token
apply muonmesh-submitter --from-file=ca.crt=ca.pem --from-file=token=submitter.token
echo "make-secrets: Secrets muonmesh-coordinator-tls, muonmesh-tokens, muonmesh-worker-tls and" \
  "muonmesh-submitter in namespace $ns; CA and tokens kept in $dir"
