"""Estimation and planning: the memory model (:mod:`~megazero.planning.estimate`, from
:mod:`~megazero.planning.model_state` and :mod:`~megazero.planning.activations`), its measurement
(:mod:`~megazero.training.measure`), FLOPs (:mod:`~megazero.planning.flops`), calibration on the
machine at hand (:mod:`~megazero.planning.calibrate`) and the layout planner
(:mod:`~megazero.planning.planner`).  The training engine imports only FLOPs from here."""
