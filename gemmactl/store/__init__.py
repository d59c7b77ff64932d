"""The local store: the manifest of what it holds, model references, the embedded model, made artifacts."""

from gemmactl.store.manifest import Artifact, Store, directory_size, home_dir, utc_now

__all__ = ["Artifact", "Store", "directory_size", "home_dir", "utc_now"]
