"""The flag on a decode server: the admission guard that refuses at once a request decode can
never hold (:mod:`.admission`, pure) and its hooks (:mod:`.server`; 0.5.23's in
:mod:`.server_v0523`). This package's ``__init__`` imports nothing."""
