"""The performance model: seed formulas (formulas), what ranks, links and CPUs are
(model), and how CPU quotas and shared cores play out a step (quota_sim). Pure: it
measures nothing (training.planner does) and knows no strategy (each strategy's cost
model, training.strategies.<name>.cost, does)."""
