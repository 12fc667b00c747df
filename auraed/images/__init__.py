"""Images: the content-addressed blob store, layer unpacking into overlayfs snapshots, registry access."""
