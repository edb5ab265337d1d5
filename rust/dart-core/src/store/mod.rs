//! Memory-mapped 3-gram store (format, reader, builder, importer). Owned by the store work.
