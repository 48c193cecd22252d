# shellcheck shell=bash disable=SC2154  # prog is set by the sourcing script
# Shared argument handling of the single-node launchers (local.sh, local_deepspeed.sh), sourced by
# them after they set `prog`: die/usage, --help, the DRY_RUN check, and the CONFIG argument.
# Sets `config` and leaves the remaining arguments for the caller to `shift` past (one).

die() {
    printf '%s: error: %s\n' "$prog" "$*" >&2
    exit 2
}

usage() {
    sed -n '2,/^# See docs/s/^# \{0,1\}//p' "$0"
}

if [[ $# -lt 1 ]]; then
    usage >&2
    exit 2
fi
case "$1" in
    -h | --help)
        usage
        exit 0
        ;;
esac

case "${DRY_RUN:-0}" in
    0 | 1) ;;
    *) die "DRY_RUN must be 0 or 1, got '${DRY_RUN}'" ;;
esac

config="$1"
[[ -f "$config" ]] || die "config file not found: $config"

# Print the exact environment (the names in managed_env) and command, shell-quoted, to stdout: in a
# dry run that output is a runnable script. Then run the command (exec), unless DRY_RUN=1.
print_and_run() {
    printf 'export'
    for var in "${managed_env[@]}"; do printf ' %q' "$var=${!var}"; done
    printf '\n%q' "$1"
    printf ' %q' "${@:2}"
    printf '\n'
    if [[ "${DRY_RUN:-0}" == 1 ]]; then
        printf '%s: DRY_RUN=1: not running\n' "$prog" >&2
        exit 0
    fi
    exec "$@"
}
