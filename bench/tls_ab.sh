#!/bin/bash
# bench/tls_ab.sh [ROUNDS]: cached 4 KiB random reads at QD32 (W4's shape,
# a 256 MiB working set read once with 64 KiB reads first) through cairn
# and nbdkit, each in clear text and through TLS (X.509), interleaved, on a
# 1 GiB cache file in /var/tmp/tlsprof. Lighter than bench/run.sh (no slow
# origin, no harness), so the TLS cost shows with less noise. Needs fio,
# nbdkit, openssl (scripts/tls-test-pki.sh makes the certificates).
set -e
cd "$(dirname "$0")/.."
CAIRN=$PWD/target/release/cairn
cargo build --release -p cairn
mkdir -p /var/tmp/tlsprof && cd /var/tmp/tlsprof
PKI=/var/tmp/tlsprof/pki
[ -f $PKI/server/server-cert.pem ] || sh "$OLDPWD/scripts/tls-test-pki.sh" $PKI
H=$PKI/libnbd-home
CERT=$PKI/server
[ -f o.img ] || truncate -s 1G o.img
[ -f c.img ] || fallocate -l 1G c.img
$CAIRN format --cache c.img --origin o.img --force >/dev/null
run() { # name uri
  HOME=$H fio --name=pw --ioengine=nbd --uri="$2" --rw=randread --bs=64k --iodepth=16 --size=256M --output-format=terse >/dev/null 2>&1
  HOME=$H fio --name=w4 --ioengine=nbd --uri="$2" --rw=randread --bs=4k --iodepth=32 --size=256M --time_based --runtime=5 --output-format=json 2>/dev/null | sed -n '/^{/,$p' | python3 -c "import json,sys; j=json.load(sys.stdin)['jobs'][0]['read']; print('$1', int(j['iops']))"
}
for r in $(seq ${1:-3}); do
  for sys in cairn cairn-tls nbdkit nbdkit-tls; do
    pkill -f "cairn serve --cache c.img" || true; pkill -f "nbdkit.*c.img" || true; sleep 0.5; rm -f s.sock
    case $sys in
      cairn) $CAIRN serve --cache c.img --socket $PWD/s.sock >serve.log 2>&1 & U="nbd+unix:///?socket=$PWD/s.sock";;
      cairn-tls) $CAIRN serve --cache c.img --socket $PWD/s.sock --tls-certificates $CERT >serve.log 2>&1 & U="nbds+unix:///?socket=$PWD/s.sock";;
      nbdkit) nbdkit -U $PWD/s.sock file c.img; U="nbd+unix:///?socket=$PWD/s.sock";;
      nbdkit-tls) nbdkit -U $PWD/s.sock --tls=require --tls-certificates=$CERT file c.img; U="nbds+unix:///?socket=$PWD/s.sock";;
    esac
    for i in $(seq 50); do [ -S s.sock ] && break; sleep 0.1; done; sleep 0.3
    run $sys "$U"
  done
done
pkill -f "cairn serve --cache c.img" || true; pkill -f "nbdkit.*c.img" || true
