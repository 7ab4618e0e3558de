//! Placeholder: replaced by the slab-backed doubly linked list.
