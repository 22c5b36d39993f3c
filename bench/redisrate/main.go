package main

import (
	_ "github.com/go-redis/redis_rate/v10"
	_ "github.com/redis/go-redis/v9"
)

func main() {}
