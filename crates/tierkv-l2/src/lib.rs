//! tierkv-l2: the host-memory tier (work in progress).
