#!/usr/bin/env bash
# staticcheck.sh: staticcheck (honnef.co/go/tools), pinned, with its default
# checks, over the root module and the integration modules (make lint).
#
# The root module is checked once per build configuration (staticcheck
# -matrix): the default build, the portable kernels (-tags purego) and,
# where the Open MPI headers are installed, -tags mpi. A finding is printed
# with the configurations that have it, and code unused in one
# configuration but used in another (comm/mpi's watchdog without -tags mpi)
# is not a finding. Without the headers, comm/mpi is checked without U1000
# (unused code), and a line says so.
#
# Settings (environment): STATICCHECK_VERSION (default v0.8.2, the release
# 2026.2.2; go install fetches it through the module proxy where it is not
# in the module cache), GO.
set -u

GO=${GO:-go}
VERSION=${STATICCHECK_VERSION:-v0.8.2}
cd "$(dirname "$0")/.." || exit 1
root=$PWD

bin=$(mktemp -d)
trap 'rm -rf "$bin"' EXIT
if ! GOBIN=$bin "$GO" install "honnef.co/go/tools/cmd/staticcheck@$VERSION"; then
	echo "staticcheck: installing honnef.co/go/tools/cmd/staticcheck@$VERSION failed"
	exit 1
fi
sc=$bin/staticcheck

fail=0
matrix=$'default:\npurego: -tags=purego'
if pkg-config --exists ompi-c 2>/dev/null; then
	"$sc" -matrix ./... <<<"$matrix"$'\nmpi: -tags=mpi' || fail=1
else
	echo "staticcheck: comm/mpi checked without U1000 (unused code): its MPI files need the Open MPI headers (apt-get install libopenmpi-dev)"
	pkgs=$("$GO" list ./... | grep -vx 'github.com/lowbit-ml/lowbit/comm/mpi')
	# shellcheck disable=SC2086 # a list of packages
	"$sc" -matrix $pkgs <<<"$matrix" || fail=1
	"$sc" -checks inherit,-U1000 ./comm/mpi || fail=1
fi

for mod in integrations/gomlx integrations/gorgonia; do
	if ! (cd "$root/$mod" && "$sc" ./...); then
		echo "staticcheck: $mod: findings above"
		fail=1
	fi
done
[ "$fail" -eq 0 ] && echo "staticcheck $("$sc" -version | cut -d' ' -f2-): no findings"
exit "$fail"
