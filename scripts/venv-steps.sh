# Sourced by the ensure-venv* scripts: a disk-space check before a build, and install steps whose output (pip's
# resolver notices, this machine's index warnings) goes to one log file, shown only when a step fails.

# require_free_space GB DIR WHAT: stop before pip does when DIR's disk has less than GB gigabytes free, instead of
# ending in "[Errno 28] No space left on device" halfway through an install.
require_free_space() {
    local need_gb=$1 dir=$2 what=$3 free_gb
    free_gb=$(($(df -Pk "$dir" | awk 'NR == 2 { print $4 }') / 1024 / 1024))
    if [ "$free_gb" -lt "$need_gb" ]; then
        echo "[vimeflow] $what needs about $need_gb GB free on the disk of $dir; it has $free_gb GB." \
            "Free some space (old virtual environments, caches, clones) and run this again." >&2
        exit 1
    fi
}

# step CMD...: run one install command, its output appended to $install_log.
step() {
    if ! "$@" >>"$install_log" 2>&1; then
        echo "[vimeflow] this install step failed: $*" >&2
        tail -n 30 "$install_log" >&2
        echo "[vimeflow] the whole log: $install_log" >&2
        exit 1
    fi
}
