// A real data race: two threads increment an unguarded counter. TSan must report it
// (interposer_test.sh), which shows the tsan build catches races with the interposer linked.

#include <cstdio>
#include <thread>

int main() {
  int counter = 0;
  auto add = [&counter] {
    for (int i = 0; i < 1000; ++i) ++counter;
  };
  std::thread a(add), b(add);
  a.join();
  b.join();
  std::printf("%d\n", counter);
  return 0;
}
