"""Admin's ω initialisation modes (init.admin.mode): its own module, so the config check reads the
list without importing the model (config -> admin -> model -> config was a cycle)."""
MODES = ("profile", "closed_form")  # profile: Liu et al.'s profiling pass; closed_form: the O(log N) formula
