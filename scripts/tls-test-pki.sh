#!/bin/sh
# scripts/tls-test-pki.sh DIR: throwaway X.509 credentials for tests and
# benchmarks (never for production: the keys are unencrypted and the
# certificates last two days), made with the openssl command, in the
# directory layout nbdkit, qemu and libnbd share:
#
#   DIR/server/        ca-cert.pem server-cert.pem server-key.pem
#                      (CN=localhost, SAN DNS:localhost IP:127.0.0.1)
#   DIR/client/        ca-cert.pem client-cert.pem client-key.pem (CN=alice)
#   DIR/no-cert/       ca-cert.pem only (trusts the server, no certificate)
#   DIR/rogue-client/  ca-cert.pem, and a client certificate of another CA
#   DIR/trusts-rogue/  the other CA as ca-cert.pem (does not trust the
#                      server), and that CA's client certificate
#   DIR/libnbd-home/.pki/libnbd/ca-cert.pem
#                      HOME for libnbd clients that cannot name a
#                      directory (fio's nbd engine)
set -eu
dir=${1:?usage: tls-test-pki.sh DIR}
mkdir -p "$dir"
cd "$dir"
ec="-newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes"
# qemu insists on keyEncipherment even for EC keys.
usage="keyUsage=critical,digitalSignature,keyEncipherment"

make_ca() { # DIR CN
  mkdir -p "$1"
  openssl req -x509 $ec -keyout "$1/ca-key.pem" -out "$1/ca-cert.pem" \
    -subj "/CN=$2" -days 2 -addext basicConstraints=critical,CA:TRUE \
    -addext keyUsage=critical,keyCertSign,cRLSign 2>/dev/null
}

make_leaf() { # CA-DIR OUT-DIR PREFIX CN EXTENSIONS
  mkdir -p "$2"
  openssl req $ec -keyout "$2/$3-key.pem" -out "$2/$3.csr" -subj "/CN=$4" 2>/dev/null
  printf "$5" > "$2/$3.ext"
  openssl x509 -req -in "$2/$3.csr" -CA "$1/ca-cert.pem" -CAkey "$1/ca-key.pem" \
    -CAcreateserial -out "$2/$3-cert.pem" -days 2 -extfile "$2/$3.ext" 2>/dev/null
  rm -f "$2/$3.csr" "$2/$3.ext"
}

make_ca ca "cairn test CA"
make_ca rogue-ca "rogue CA"
make_leaf ca server server localhost \
  "subjectAltName=DNS:localhost,IP:127.0.0.1\nextendedKeyUsage=serverAuth\n$usage\n"
make_leaf ca client client alice "extendedKeyUsage=clientAuth\n$usage\n"
make_leaf rogue-ca rogue-client client mallory "extendedKeyUsage=clientAuth\n$usage\n"
mkdir -p no-cert trusts-rogue libnbd-home/.pki/libnbd
for d in server client no-cert rogue-client libnbd-home/.pki/libnbd; do
  cp ca/ca-cert.pem "$d/ca-cert.pem"
done
cp rogue-ca/ca-cert.pem trusts-rogue/ca-cert.pem
cp rogue-client/client-cert.pem rogue-client/client-key.pem trusts-rogue/
chmod 600 */*-key.pem
