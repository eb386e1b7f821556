"""What the user sets and what the plugin reads from it: every knob (:mod:`.config`), the flag
on SGLang's ``ServerArgs`` and its validation (:mod:`.server_args`; 0.5.23's settings layer in
:mod:`.server_args_v0523`), and the settings that must be equal on every CP rank
(:mod:`.rank_settings`). This package's ``__init__`` imports nothing."""
