"""Fleet economics: sleep/wake of replicas, cached-token accounting, cost, and pool scaling signals."""
