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

# The guest architecture: SANDBOX_HOST_ARCH (auto, x86_64, aarch64), else this host's.
sandbox_guest_arch() {
  local a=${SANDBOX_HOST_ARCH:-auto}
  [ "$a" = auto ] && a=$(uname -m)
  case "$a" in
    x86_64|amd64) echo x86_64 ;;
    aarch64|arm64) echo aarch64 ;;
    *) echo "SANDBOX_HOST_ARCH must be one of auto, x86_64, aarch64; it is \`$a\`" >&2; return 2 ;;
  esac
}

# The image store: SANDBOX_HOST_IMAGE_DIR, else <cache>/images for guests of this host's
# architecture and <cache>/images-<arch> for emulated ones (as sandbox_vmm::config::image_dir).
sandbox_image_dir() {
  local arch host
  arch=$(sandbox_guest_arch) || return 2
  host=$(SANDBOX_HOST_ARCH=auto sandbox_guest_arch)
  if [ -n "${SANDBOX_HOST_IMAGE_DIR:-}" ]; then
    echo "$SANDBOX_HOST_IMAGE_DIR"
  elif [ "$arch" = "$host" ]; then
    echo "$(sandbox_cache_dir)/images"
  else
    echo "$(sandbox_cache_dir)/images-$arch"
  fi
}
