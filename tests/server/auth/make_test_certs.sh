#!/usr/bin/env bash
# Test certificates for the security tests, made fresh in DIR with openssl
# (valid for two days; nothing here is a secret worth keeping):
#   ca.pem ca.key                 the CA of the deployment
#   server.pem server.key         the coordinator: CN muonmesh-coordinator,
#                                 subjectAltName IP 127.0.0.1 and localhost
#   worker.pem worker.key         a worker's client certificate (clientAuth)
#   worker-w7.pem worker-w7.key   one worker's own: CN w7, subjectAltName
#                                 DNS w7.workers.test
#   rogue-ca.pem, rogue-worker.pem rogue-worker.key
#                                 a client certificate from another CA
#
#   tests/server/auth/make_test_certs.sh DIR
set -euo pipefail
dir=${1:?usage: $0 DIR}
mkdir -p "$dir"
cd "$dir"
umask 077

key() { openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256 -out "$1" 2>/dev/null; }

ca() {  # NAME CN
  key "$1.key"
  openssl req -x509 -new -key "$1.key" -out "$1.pem" -days 2 -subj "/CN=$2" \
    -addext "basicConstraints=critical,CA:TRUE" \
    -addext "keyUsage=critical,keyCertSign,cRLSign" 2>/dev/null
}

leaf() {  # NAME CA CN EXTENSIONS
  key "$1.key"
  openssl req -new -key "$1.key" -out "$1.csr" -subj "/CN=$3" 2>/dev/null
  printf '%s\n' "$4" > "$1.ext"
  openssl x509 -req -in "$1.csr" -CA "$2.pem" -CAkey "$2.key" -CAcreateserial \
    -CAserial "$2.srl" -out "$1.pem" -days 2 -extfile "$1.ext" 2>/dev/null
  rm -f "$1.csr" "$1.ext"
}

ca ca "muonmesh test CA"
leaf server ca muonmesh-coordinator \
  "subjectAltName=IP:127.0.0.1,DNS:localhost
extendedKeyUsage=serverAuth
keyUsage=critical,digitalSignature"
leaf worker ca muonmesh-worker \
  "extendedKeyUsage=clientAuth
keyUsage=critical,digitalSignature"
leaf worker-w7 ca w7 \
  "subjectAltName=DNS:w7.workers.test
extendedKeyUsage=clientAuth
keyUsage=critical,digitalSignature"
ca rogue-ca "someone else's CA"
leaf rogue-worker rogue-ca muonmesh-worker \
  "extendedKeyUsage=clientAuth
keyUsage=critical,digitalSignature"
chmod 644 ./*.pem
echo "certificates in $dir"
