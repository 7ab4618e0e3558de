//! tierkv-disk: the persistent disk tier (work in progress).
