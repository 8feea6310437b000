"""Load testing: CPU baseline servers, the locust harness, the scenario runner, report and cost."""
