# Sourced by the build scripts: where sandbox-host keeps what it builds outside the checkout.
# SANDBOX_HOST_CACHE overrides; else $XDG_CACHE_HOME/sandbox-host; else ~/.cache/sandbox-host.
sandbox_cache_dir() {
  if [ -n "${SANDBOX_HOST_CACHE:-}" ]; then
    echo "$SANDBOX_HOST_CACHE"
  elif [ -n "${XDG_CACHE_HOME:-}" ]; then
    echo "$XDG_CACHE_HOME/sandbox-host"
  else
    echo "$HOME/.cache/sandbox-host"
  fi
}
