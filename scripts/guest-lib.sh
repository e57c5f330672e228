# Shared by scripts/fetch-{sqlite,zstd,programs}.sh (sourced, not run): the guest cache, build
# keys, pinned downloads. A built module lands in the cache with a `.key` file naming what it
# was built from; it is rebuilt when that changes.
cache="${FERRY_GUEST_CACHE:-$HOME/.cache/ferry/guests}"
mkdir -p "$cache"

# build_key WORDS FILE...: 16 hex digits over the words and the files' contents.
build_key() {
    local words="$1"
    shift
    (echo "$words"; cat "$@") | sha256sum | cut -c1-16
}

# up_to_date DEST KEY: DEST exists and was built from KEY.
up_to_date() { [ -f "$1" ] && [ "$(cat "$1.key" 2>/dev/null)" = "$2" ]; }

# built DEST KEY: moves DEST.tmp into place and records KEY.
built() {
    mv "$1.tmp" "$1"
    echo "$2" > "$1.key"
    echo "$(basename "$1"): built ($1)"
}

# verify FILE SHA256: refuses (exits) unless FILE has that digest.
verify() {
    if ! echo "$2  $1" | sha256sum -c --status; then
        echo "$(basename "$1"): SHA-256 mismatch, refusing it" >&2
        exit 1
    fi
}
